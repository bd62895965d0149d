"""The ``show`` command's work: filter a recording's timeline and print it, as text or JSON Lines.

Text lines read ``TIME  conn N  C->B  COMMAND  topic  fields  size  [messages]
latency  rules``; colours (ANSI) only when asked or when stdout is a terminal and
``NO_COLOR`` is unset.  Filters apply after decoding, so topics are resolved for
id-only commands even when their PRODUCER/SUBSCRIBE is filtered out.  A summary
(frames shown, connections, frames dropped by the recorder, bytes lost to a
crash) goes to stderr so stdout stays one line per frame.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from proxy.errors import UsageError
from proxy.protocol.commands import TYPE_VALUES
from proxy.recording.reader import open_recordings
from proxy.recording.timeline import TimelineEntry, build_timeline, summary_fields

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


@dataclass(frozen=True, slots=True)
class ShowOptions:
    conns: frozenset[int] = frozenset()
    topics: tuple[str, ...] = ()
    commands: frozenset[str] = frozenset()
    json: bool = False
    diagram: str | None = None
    color: str = "auto"

    @classmethod
    def from_args(cls, *, conns: Sequence[str] = (), topics: Sequence[str] = (), commands: Sequence[str] = (),
                  json: bool = False, diagram: str | None = None, color: str = "auto") -> ShowOptions:
        conn_ids: set[int] = set()
        for value in _split(conns):
            if not value.isdigit():
                raise UsageError(f"--conn takes connection ids (integers), not {value!r}")
            conn_ids.add(int(value))
        names: set[str] = set()
        for value in _split(commands):
            name = value.upper()
            if name not in TYPE_VALUES:
                raise UsageError(f"--command: unknown command type {value!r}")
            names.add(name)
        return cls(frozenset(conn_ids), tuple(topics), frozenset(names), json, diagram, color)

    def matches(self, entry: TimelineEntry) -> bool:
        if self.conns and entry.frame.conn not in self.conns:
            return False
        if self.commands and entry.command not in self.commands:
            return False
        if self.topics:
            topic = entry.topic
            if topic is None or not any(fnmatch.fnmatchcase(topic, pattern) for pattern in self.topics):
                return False
        return True


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


def show(path: str, options: ShowOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the recording at ``path``; write the diagram if asked.  Returns the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    recordings = open_recordings(path)
    color = not options.json and use_color(options.color, out)
    diagram_entries: list[TimelineEntry] | None = [] if options.diagram else None
    shown = 0
    try:
        for entry in build_timeline(recordings.frames()):
            if not options.matches(entry):
                continue
            shown += 1
            if options.json:
                out.write(json.dumps(entry.to_json(), separators=(",", ":")) + "\n")
            else:
                out.write(format_entry(entry, color) + "\n")
            if diagram_entries is not None:
                diagram_entries.append(entry)
        out.flush()
    except BrokenPipeError:
        # The reader (e.g. `head`) went away: stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        return 0
    if diagram_entries is not None and options.diagram is not None:
        from proxy.recording.diagram import write_diagram

        write_diagram(Path(options.diagram), diagram_entries, recordings.connections,
                      title=", ".join(r.id for r in recordings.recordings))
        err.write(f"diagram: {options.diagram}\n")
    notes = [f"{shown} frames", f"{len(recordings.connections)} connections"]
    if recordings.frames_dropped:
        notes.append(f"{recordings.frames_dropped} frames dropped by the recorder")
    if recordings.truncated_bytes:
        notes.append(f"{recordings.truncated_bytes} bytes of a cut-off record ignored")
    if not options.json:
        err.write("; ".join(notes) + "\n")
    return 0


__all__ = ["ShowOptions", "format_entry", "format_latency", "format_time", "show", "use_color"]
