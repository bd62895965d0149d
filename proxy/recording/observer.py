"""The recorder as a proxy observer: FrameEvent / ConnectionEvent in, Recorder calls out.

The proxy's :class:`~proxy.server.observer_hub.ObserverHub` hands each observer
every frame (as received, and again with origin ``proxy`` for what it changed or
originated) and every connection opening and closing.  :class:`RecordingObserver`
passes them to a recorder (:class:`~proxy.recording.writer.FrameRecorder`; the proxy's is
:class:`proxy.server.recorder.Recorder`), which queues them
without blocking.  Frames the proxy passed through unchanged come in bulk
(:class:`~proxy.core.hooks.RunEvent`: the bytes of a stretch of one direction)
and the Recorder cuts them into frame records in its writer process, so recording
decodes nothing on the relay's path.  The broker address comes from the connection's upstream URL
(``pulsar://host:port``); ``frame_filter`` lets a ``record`` rule keep only the
frames it matches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from proxy.core.hooks import ConnectionEvent, FrameEvent, RunEvent
from proxy.recording.writer import Address, FrameRecorder


def broker_address(url: str | None) -> Address:
    """``(host, port)`` of a ``pulsar://`` or ``pulsar+ssl://`` URL; None when unknown or unparsable."""
    if not url:
        return None
    try:
        parts = urlsplit(url if "://" in url else f"pulsar://{url}")
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None:
        return None
    default_port = 6651 if parts.scheme.endswith("ssl") else 6650
    return (parts.hostname, port or default_port)


class RecordingObserver:
    """Feeds a running recorder from the proxy's observer hub."""

    #: the recorder keeps raw bytes; the frame filter looks at ``fired`` only
    needs_observation = False
    #: called by the hub as events are published (the recorder only queues them, copying a run's
    #: bytes): no hop through the hub's queue, and the recording keeps the order of publication
    immediate = True

    def __init__(self, recorder: FrameRecorder, *, lookup_mode: str | None = None,
                 frame_filter: Callable[[FrameEvent], bool] | None = None) -> None:
        self.recorder = recorder
        self.lookup_mode = lookup_mode
        self.frame_filter = frame_filter

    def on_frame(self, event: FrameEvent) -> None:
        if self.frame_filter is not None and not self.frame_filter(event):
            return
        self.recorder.record(event.connection.conn_id, event.direction, event.origin, event.ts_ns,
                             event.frame.raw, event.fired)

    def on_run(self, event: RunEvent) -> None:
        # No rule looked at these frames, so none fired: the filter (which reads only ``fired``)
        # decides for all of them at once.
        if self.frame_filter is not None and not self.frame_filter(cast(FrameEvent, event)):
            return
        self.recorder.record_run(event.connection.conn_id, event.direction, event.ts_ns, event.data,
                                 event.lead, event.stream_pos, event.frames)

    def on_connection(self, event: ConnectionEvent) -> None:
        conn = event.connection
        if event.closed:
            self.recorder.close_connection(conn.conn_id, event.ts_ns)
        else:
            self.recorder.open_connection(conn.conn_id, conn.client, broker_address(conn.broker_url),
                                          self.lookup_mode, event.ts_ns)


__all__ = ["RecordingObserver", "broker_address"]
