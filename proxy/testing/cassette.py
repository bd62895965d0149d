"""Cassettes: a test's broker traffic recorded once, then served broker-side so the test needs no broker.

A cassette is a directory holding one or more recordings (the format of
``recordings/FORMAT.md``; ``pulsar-tap show`` reads it).  What a test run does with
it follows VCR.py's record modes:

=================  ================================================================
``once``           replay the cassette if it exists, else record it (the default)
``new_episodes``   replay what the cassette answers, forward the rest to the real
                   upstream and add that to the cassette (alias ``new``)
``none``           replay only; a missing cassette is an error; never contacts the upstream
``all``            always record against the upstream, replacing the cassette
=================  ================================================================

Recording puts a recording proxy (:class:`~proxy.testing.rig.RecordingProxy`)
between the test's tap and the upstream, so a cassette holds what the broker was
asked and answered; the tap's own rules act in front of it exactly as in a replay.
Replaying serves the cassette with ``pulsar-tap replay --serve``'s machinery
(:class:`~proxy.replay.server.ReplayServer`): requests matched by command and key
fields (topic, subscription, producer name, message order), never by ids, so the
replayed test must use the topics and names it used when recording.  A request the
cassette cannot answer gets ERROR ``UnknownError`` "not in recording" and is counted
in :attr:`CassetteSession.unmatched`.  A cassette is written only by
:meth:`CassetteSession.finish` with ``save=True`` (the plugin passes whether the
test passed), so a failed recording run leaves the old cassette as it was.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from proxy.errors import RecordingError
from proxy.testing.errors import TapError

RECORD_MODES: Final = ("once", "new_episodes", "none", "all")
_ALIASES: Final = {"new": "new_episodes"}

Plan = Literal["record", "replay", "extend"]


class CassetteMissing(TapError):
    """Record mode ``none`` and the cassette does not exist."""


def record_mode(name: str) -> str:
    """The VCR.py record mode ``name`` stands for; ValueError for anything else."""
    mode = _ALIASES.get(name, name)
    if mode not in RECORD_MODES:
        raise ValueError(f"record mode must be one of {', '.join(RECORD_MODES)} (or new), not {name!r}")
    return mode


@dataclass(frozen=True)
class Cassette:
    """The cassette at ``path`` used in ``mode`` (see the module docstring)."""

    path: Path
    mode: str = "once"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", record_mode(self.mode))

    @property
    def exists(self) -> bool:
        from proxy.recording.reader import find_recordings

        try:
            return bool(find_recordings(self.path))
        except RecordingError:
            return False

    def plan(self) -> Plan:
        """What this run does: ``record``, ``replay`` or ``extend`` (replay and record what is new)."""
        if self.mode == "all":
            return "record"
        if self.exists:
            return "extend" if self.mode == "new_episodes" else "replay"
        if self.mode == "none":
            raise CassetteMissing(f"cassette {self.path} does not exist and the record mode is none "
                                  "(record it with --pulsar-record-mode=once or all)")
        return "record"

    def open(self, upstream: Callable[[], str] | str | None = None) -> CassetteSession:
        """Start what the plan needs; ``upstream`` (a URL, or a function giving it) is asked for only when
        the plan contacts the real broker."""
        plan = self.plan()
        session = CassetteSession(self, plan)
        try:
            if plan != "replay":
                if upstream is None:
                    raise TapError(f"cassette {self.path}: recording needs an upstream broker")
                session._start_recording(upstream() if callable(upstream) else upstream)
            if plan != "record":
                session._start_replay()
        except BaseException:
            session.finish(save=False)
            raise
        return session


class CassetteSession:
    """One test's use of a cassette: connect the tap to :attr:`service_url`, then :meth:`finish`."""

    def __init__(self, cassette: Cassette, plan: Plan) -> None:
        from proxy.testing.rig import RecordingProxy, ThreadedReplayServer

        self.cassette = cassette
        self.plan: Plan = plan
        self._recorder: RecordingProxy | None = None
        self._replayer: ThreadedReplayServer | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        #: requests the cassette could not answer (replay and extend: forwarded and recorded instead)
        self.unmatched = 0
        self.service_url = ""

    @property
    def replaying(self) -> bool:
        """True when the test is answered from the cassette (no broker contacted for what it holds)."""
        return self.plan != "record"

    def _start_recording(self, upstream: str) -> None:
        from proxy.testing.rig import RecordingProxy

        self._scratch = tempfile.TemporaryDirectory(prefix="pulsar-cassette-")
        self._recorder = RecordingProxy(upstream, self._scratch.name).start()
        self.service_url = self._recorder.service_url

    def _start_replay(self) -> None:
        from proxy.recording.reader import open_recordings
        from proxy.replay.conversation import build_conversations
        from proxy.replay.matcher import AnswerBook
        from proxy.testing.rig import ThreadedReplayServer

        try:
            frames = open_recordings(self.cassette.path).frames()
            book = AnswerBook.from_conversations(build_conversations(frames).values())
        except RecordingError as exc:
            raise TapError(f"cassette {self.cassette.path}: {exc}") from None
        if self._recorder is not None:
            self._replayer = ThreadedReplayServer(book, unmatched="forward", upstream=self._recorder.service_url)
        else:
            self._replayer = ThreadedReplayServer(book, unmatched="error")
        self._replayer.start()
        self.service_url = self._replayer.service_url

    def finish(self, *, save: bool) -> None:
        """Stop everything; with ``save``, write what was recorded into the cassette."""
        replayer, self._replayer = self._replayer, None
        recorder, self._recorder = self._recorder, None
        try:
            if replayer is not None:
                replayer.stop()
                self.unmatched = replayer.server.stats.unmatched
            if recorder is not None:
                recorder.stop()
                if save:
                    self._save(recorder.recording_path)
        finally:
            if self._scratch is not None:
                self._scratch.cleanup()
                self._scratch = None

    def _save(self, recorded: Path) -> None:
        from proxy.recording.reader import Recording

        target = self.cassette.path
        if self.plan == "extend":
            if not Recording(recorded).connections:
                return  # the cassette answered everything: nothing new to keep
        elif target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True, exist_ok=True)
        shutil.move(str(recorded), str(target / recorded.name))


__all__ = ["RECORD_MODES", "Cassette", "CassetteMissing", "CassetteSession", "Plan", "record_mode"]
