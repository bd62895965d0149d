"""Recording Pulsar sessions: the segment format, the Trio recorder, readers, show and export.

The format (proto/recording.proto, recordings/FORMAT.md) is written by
:class:`~proxy.recording.recorder.Recorder` and read by
:func:`~proxy.recording.reader.open_recordings`.
"""

from proxy.recording.reader import (
    ReadReport,
    RecordedFrame,
    Recording,
    RecordingFollower,
    RecordingSet,
    open_recordings,
)
from proxy.recording.recorder import RecordConfig, Recorder, RecorderStats

__all__ = ["ReadReport", "RecordConfig", "RecordedFrame", "Recorder", "RecorderStats", "Recording",
           "RecordingFollower", "RecordingSet", "open_recordings"]
