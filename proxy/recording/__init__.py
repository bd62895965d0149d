"""Recording Pulsar sessions: the segment format, the writer, readers, show and export.

The format (proto/recording.proto, recordings/FORMAT.md) is written by
:mod:`proxy.recording.writer` (fed by the proxy's Trio recorder,
:class:`proxy.server.recorder.Recorder`) and read by
:func:`~proxy.recording.reader.open_recordings`.  Nothing here imports trio.
"""

from proxy.recording.reader import (
    ReadReport,
    RecordedFrame,
    Recording,
    RecordingFollower,
    RecordingSet,
    open_recordings,
)
from proxy.recording.writer import RecordConfig, RecorderStats

__all__ = ["ReadReport", "RecordConfig", "RecordedFrame", "RecorderStats", "Recording",
           "RecordingFollower", "RecordingSet", "open_recordings"]
