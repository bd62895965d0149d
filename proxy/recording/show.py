"""The ``show`` command's work: filter a recording's timeline and print it, as text or JSON Lines.

Text lines read ``TIME  conn N  C->B  COMMAND  topic  fields  size  [messages]
latency  rules``, and for geo-replication traffic the marker (type, snapshot or
subscription, cluster@position) or the cluster a message was replicated from;
colours (ANSI) only when asked or when stdout is a terminal and ``NO_COLOR`` is
unset.  Filters (connection, topic — full or short names, as the
broker reads them, partitions included —, command, time range, request id,
producer name, sequence id) apply after decoding, so topics and producer names
are resolved for id-only commands even when their PRODUCER/SUBSCRIBE is filtered
out.  A summary (frames shown, connections, frames dropped by the recorder) goes
to stderr so stdout stays one line per frame; what the reader skipped in a
damaged recording is one warning line on stderr and, with ``--json``, a last
line ``{"problems": [...], ...}`` (recordings/FORMAT.md).

``--follow`` reads the recording as the proxy writes it
(:class:`~proxy.recording.reader.RecordingFollower`): what is already recorded
goes through the session trackers (so topics and latencies stay right) and only
frames after it are printed, unless ``--since`` asks for earlier ones.  SIGINT or
SIGTERM ends ``show`` with its summary, exit 0.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from proxy.errors import UsageError
from proxy.protocol.commands import TYPE_VALUES
from proxy.recording.output import check_output_file
from proxy.recording.reader import ReadReport, RecordingFollower, open_recordings
from proxy.recording.timeline import TimelineEntry, build_timeline, summary_fields
from proxy.recording.timerange import Moment, parse_moment
from proxy.wording import counted

_RESET = "\x1b[0m"
_DIM = "\x1b[2m"
_BOLD = "\x1b[1m"
_RED = "\x1b[31m"
_GREEN = "\x1b[32m"
_YELLOW = "\x1b[33m"
_BLUE = "\x1b[34m"
_MAGENTA = "\x1b[35m"
_CYAN = "\x1b[36m"

_ERROR_COMMANDS = frozenset({"ERROR", "SEND_ERROR"})
_PAYLOAD_COMMANDS = frozenset({"SEND", "MESSAGE"})
_ARROWS = {("client", "to_broker"): "C->B", ("broker", "to_client"): "B->C",
           ("proxy", "to_broker"): "P->B", ("proxy", "to_client"): "P->C",
           ("client", "to_client"): "C->C", ("broker", "to_broker"): "B->B"}


_PARTITION = re.compile(r"-partition-\d+$")


def topic_patterns(pattern: str) -> tuple[str, ...]:
    """The full-name globs a ``--topic`` value stands for, short names read as the broker reads them.

    ``orders`` is ``persistent://public/default/orders``, ``acme/ns/orders`` is
    ``persistent://acme/ns/orders``; a value with ``://`` is taken as it is.  The
    value itself is kept too, so globs written against full names still work.
    """
    if "://" in pattern:
        return (pattern,)
    parts = pattern.split("/")
    if len(parts) == 1:
        return (pattern, f"persistent://public/default/{pattern}")
    if len(parts) == 3:
        return (pattern, f"persistent://{pattern}")
    return (pattern,)


@dataclass(frozen=True, slots=True)
class ShowOptions:
    conns: frozenset[int] = frozenset()
    topics: tuple[str, ...] = ()
    commands: frozenset[str] = frozenset()
    json: bool = False
    diagram: str | None = None
    color: str = "auto"
    since: Moment | None = None
    until: Moment | None = None
    request_ids: frozenset[int] = frozenset()
    producer_names: tuple[str, ...] = ()
    sequence_ids: frozenset[int] = frozenset()
    follow: bool = False

    @classmethod
    def from_args(cls, *, conns: Sequence[str] = (), topics: Sequence[str] = (), commands: Sequence[str] = (),
                  json: bool = False, diagram: str | None = None, color: str = "auto", since: str | None = None,
                  until: str | None = None, request_ids: Sequence[str] = (), producer_names: Sequence[str] = (),
                  sequence_ids: Sequence[str] = (), follow: bool = False,
                  now_ns: int | None = None) -> ShowOptions:
        names: set[str] = set()
        for value in _split(commands):
            name = value.upper()
            if name not in TYPE_VALUES:
                raise UsageError(f"--command: unknown command type {value!r}")
            names.add(name)
        now = time.time_ns() if now_ns is None else now_ns
        start = parse_moment(since, now, "--since") if since is not None else None
        end = parse_moment(until, now, "--until") if until is not None else None
        if start is not None and end is not None and start.from_start == end.from_start and start.ns >= end.ns:
            raise UsageError("--since must be earlier than --until")
        expanded = tuple(p for topic in _split(topics) for p in topic_patterns(topic))
        return cls(_ids(conns, "--conn"), expanded, frozenset(names), json, diagram, color, start, end,
                   _ids(request_ids, "--request-id"), tuple(_split(producer_names)),
                   _ids(sequence_ids, "--sequence-id"), follow)

    def matches(self, entry: TimelineEntry, start_ns: int = 0) -> bool:
        frame = entry.frame
        if self.conns and frame.conn not in self.conns:
            return False
        if self.commands and entry.command not in self.commands:
            return False
        if self.since is not None and frame.ts_ns < self.since.resolve(start_ns):
            return False
        if self.until is not None and frame.ts_ns >= self.until.resolve(start_ns):
            return False
        if self.topics:
            topic = entry.topic
            if topic is None:
                return False
            base = _PARTITION.sub("", topic)
            if not any(fnmatch.fnmatchcase(topic, p) or fnmatch.fnmatchcase(base, p) for p in self.topics):
                return False
        if self.request_ids and entry.fields.get("request_id") not in self.request_ids:
            return False
        if self.sequence_ids and entry.fields.get("sequence_id") not in self.sequence_ids:
            return False
        if self.producer_names:
            name = entry.producer_name
            if name is None or not any(fnmatch.fnmatchcase(name, p) for p in self.producer_names):
                return False
        return True


def _ids(values: Sequence[str], flag: str) -> frozenset[int]:
    ids: set[int] = set()
    for value in _split(values):
        if not value.isdigit():
            raise UsageError(f"{flag} takes whole numbers, not {value!r}")
        ids.add(int(value))
    return frozenset(ids)


def _split(values: Iterable[str]) -> Iterator[str]:
    for value in values:
        for part in value.split(","):
            if part.strip():
                yield part.strip()


def use_color(option: str, stream: TextIO) -> bool:
    if option == "always":
        return True
    if option == "never" or os.environ.get("NO_COLOR"):
        return False
    return stream.isatty()


def format_time(ts_ns: int) -> str:
    moment = datetime.fromtimestamp(ts_ns // 1_000_000_000, tz=UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{ts_ns % 1_000_000_000 // 1000:06d}"


def format_latency(latency_ns: int) -> str:
    if latency_ns < 1_000_000:
        return f"{latency_ns / 1000:.0f} us"
    if latency_ns < 1_000_000_000:
        return f"{latency_ns / 1_000_000:.2f} ms"
    return f"{latency_ns / 1_000_000_000:.3f} s"


def format_entry(entry: TimelineEntry, color: bool) -> str:
    """One timeline line."""
    frame = entry.frame

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color and text else text

    arrow = _ARROWS.get((frame.origin, frame.direction), "?")
    if entry.command in _ERROR_COMMANDS or entry.error or (entry.completed and entry.completed.error_code):
        command_color = _RED
    elif entry.command in _PAYLOAD_COMMANDS:
        command_color = _YELLOW
    elif frame.direction == "to_broker":
        command_color = _CYAN
    else:
        command_color = _GREEN
    parts = [paint(format_time(frame.ts_ns), _DIM), f"conn {frame.conn:<3}",
             paint(arrow, _MAGENTA if frame.origin == "proxy" else _BLUE),
             paint(f"{entry.command:<16}", _BOLD + command_color)]
    if entry.topic:
        parts.append(entry.topic)
    fields = summary_fields(entry.fields)
    if fields:
        parts.append(fields)
    parts.append(f"{frame.size} B")
    if entry.is_payload:
        detail = f"[{entry.num_messages} msg{'s' if entry.num_messages != 1 else ''}"
        if entry.compression and entry.compression != "NONE":
            detail += f", {entry.compression}"
        detail += f", payload {entry.payload_size} B]"
        parts.append(detail)
    if entry.replication is not None:
        parts.append(paint(replication_text(entry.replication), _MAGENTA))
    if entry.completed is not None:
        latency = f"latency {format_latency(entry.completed.latency_ns)}"
        if entry.completed.error_code:
            latency += f" ({entry.completed.error_code})"
        parts.append(paint(latency, _GREEN if not entry.completed.error_code else _RED))
    if frame.rules:
        parts.append(paint("rules: " + ",".join(frame.rules), _MAGENTA))
    if frame.redacted:
        parts.append(paint("(auth redacted)", _DIM))
    if frame.payload_stripped:
        parts.append(paint("(payload not recorded)", _DIM))
    if entry.error:
        parts.append(paint(f"!! {entry.error}", _RED))
    return "  ".join(parts)


def replication_text(facts: dict[str, object]) -> str:
    """``marker SNAPSHOT_RESPONSE 1b2c3d4e B@7:120 from B to A``, or ``replicated from A``."""
    origin = facts.get("replicated_from")
    targets = facts.get("replicate_to")
    text = f"marker {facts.get('label') or facts['marker']}" if "marker" in facts else "replicated"
    if origin:
        text += f" from {origin}"
    if isinstance(targets, list) and targets:
        text += " to " + ",".join(str(t) for t in targets)
    return text


class _Printer:
    """Writes the matching entries (text or JSON) and keeps them for the diagram."""

    def __init__(self, options: ShowOptions, out: TextIO) -> None:
        self.options = options
        self.out = out
        self.color = not options.json and use_color(options.color, out)
        self.diagram: list[TimelineEntry] | None = [] if options.diagram else None
        self.shown = 0
        self.start_ns: int | None = None

    def offer(self, entry: TimelineEntry, printing: bool = True) -> None:
        if self.start_ns is None:
            self.start_ns = entry.frame.ts_ns
        if not printing or not self.options.matches(entry, self.start_ns):
            return
        self.shown += 1
        if self.options.json:
            self.out.write(json.dumps(entry.to_json(), separators=(",", ":")) + "\n")
        else:
            self.out.write(format_entry(entry, self.color) + "\n")
        if self.diagram is not None:
            self.diagram.append(entry)


def show(path: str, options: ShowOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the recording at ``path``; write the diagram if asked.  Returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if options.diagram is not None:
        check_output_file(options.diagram, "--diagram")
    if options.follow:
        return _follow(path, options, out, err)
    recordings = open_recordings(path)
    printer = _Printer(options, out)
    interrupted = False
    try:
        for entry in build_timeline(recordings.frames()):
            printer.offer(entry)
        out.flush()
    except BrokenPipeError:
        _quiet(out)
        return 0
    except KeyboardInterrupt:
        interrupted = True
    _finish(printer, recordings.connections, ", ".join(r.id for r in recordings.recordings), recordings.report,
            recordings.frames_dropped, interrupted, err)
    return 0


def _follow(path: str, options: ShowOptions, out: TextIO, err: TextIO) -> int:
    def announce() -> None:
        what = ", ".join(follower.recording_ids) or f"{path} (waiting for a recording)"
        err.write(f"following {what}; SIGINT/^C stops\n")
        err.flush()

    follower = RecordingFollower(path, on_caught_up=announce)
    printer = _Printer(options, out)
    interrupted = False
    try:
        for entry in build_timeline(follower.frames()):
            printer.offer(entry, printing=follower.caught_up or options.since is not None)
            if follower.caught_up:
                out.flush()
    except BrokenPipeError:
        _quiet(out)
        return 0
    except KeyboardInterrupt:
        interrupted = True
    connections: dict[int, Any] = {}
    _finish(printer, connections, ", ".join(follower.recording_ids), follower.report, 0, interrupted, err,
            follow=True)
    return 0


def _finish(printer: _Printer, connections: dict[int, Any], title: str, report: ReadReport, dropped: int,
            interrupted: bool, err: TextIO, *, follow: bool = False) -> None:
    """The diagram, the summary on stderr, the warning, and ``--json``'s problems line."""
    options = printer.options
    if printer.diagram is not None and options.diagram is not None:
        from proxy.recording.diagram import write_diagram

        write_diagram(Path(options.diagram), printer.diagram, connections, title=title)
        err.write(f"diagram: {options.diagram}\n")
    warning = report.summary()
    if options.json and report:
        printer.out.write(json.dumps({"problems": report.problems(), "frames": printer.shown,
                                      **report.to_json()}, separators=(",", ":")) + "\n")
    printer.out.flush()
    notes = [counted(printer.shown, "frame")]
    if not follow:
        notes.append(counted(len(connections), "connection"))
    if dropped:
        notes.append(f"{counted(dropped, 'frame')} dropped by the recorder")
    if interrupted:
        notes.append("stopped by a signal")
    if not options.json or interrupted:
        err.write("; ".join(notes) + "\n")
    if warning:
        err.write(f"pulsar-tap show: warning: {warning}\n")


def _quiet(out: TextIO) -> None:
    # The reader (e.g. `head`) went away: stop quietly, as Unix tools do.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (OSError, ValueError):
        pass


__all__ = ["ShowOptions", "format_entry", "format_latency", "format_time", "show", "topic_patterns", "use_color"]
