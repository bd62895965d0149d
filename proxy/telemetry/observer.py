"""The telemetry observer: frames in, spans and metrics out.

:class:`Telemetry` is the sans-IO core.  Feed it what the relay reports —
:meth:`~Telemetry.connection_opened`, :meth:`~Telemetry.frame` (with the instant the
frame was received and, when known, the instant it was forwarded, plus the names
of the rules that fired on it) and :meth:`~Telemetry.connection_closed` — and it
keeps one :class:`~proxy.telemetry.tracker.ConnectionTimeline` per connection, hands
finished exchanges and delivery cycles to the :class:`~proxy.telemetry.tracer.SpanWriter`
(if tracing is on) and counts everything in :class:`~proxy.telemetry.metrics.ProxyMetrics`
(if metrics are on).  It never changes traffic and never raises on odd frames.

:class:`TelemetryObserver` adapts it to the proxy's observer hook
(:class:`proxy.core.hooks.Observer`): it is called from the observer task, behind
the bounded queue, never on the relay's path.  It takes the frames the proxy passed
through unchanged in bulk (``on_run``, see :mod:`proxy.core.run_cutter`), so the
relay builds no Frame and no event per frame for telemetry, and
:meth:`Telemetry.passed_run` accounts the SENDs and receipts among them a run at a
time (:mod:`proxy.telemetry.bulk`); any other frame goes the per-frame way.  While the relay reads
frames as fast as they come, a run is one frame (a SEND, or a receipt read alone): such a run takes a lane of its own,
:meth:`Telemetry.passed_send` / :meth:`Telemetry.passed_receipt`, which account it as
:meth:`Telemetry.passed_run` would without cutting and walking a run.
"""

from __future__ import annotations

import re
import struct
from typing import Final

from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, RunEvent
from proxy.core.run_cutter import RunCutter
from proxy.errors import ProtocolError
from proxy.protocol.commands import T, type_name
from proxy.protocol.frame import Frame, peek_type
from proxy.protocol.session import Direction
from proxy.telemetry.bulk import FRAME_HEAD, BookEntry
from proxy.telemetry.bulk_forms import receipt_key, send_command, take_receipts, take_sends
from proxy.telemetry.data_path import receipt_fields, searchable, send_fields
from proxy.telemetry.metrics import ProxyMetrics
from proxy.telemetry.tracer import Peer, SpanWriter
from proxy.telemetry.tracker import TRACEPARENT, ConnectionTimeline, Exchange, FrameOutcome

TRACEPARENT_BYTES: Final = TRACEPARENT.encode()
#: ``TRACEPARENT_BYTES`` searched for in a run (a ``memoryview`` has no ``find``)
_TRACEPARENT_IN: Final = re.compile(re.escape(TRACEPARENT_BYTES)).search
#: the directions (an enum's member read from its class costs ~0.08 us here, a module's name 0.01)
_TO_BROKER: Final = Direction.TO_BROKER
_TO_CLIENT: Final = Direction.TO_CLIENT
#: their label values (``Direction.value`` is a property call, ~0.1 us, twice a message in bulk)
_TO_BROKER_LABEL: Final = _TO_BROKER.value
_TO_CLIENT_LABEL: Final = _TO_CLIENT.value
#: a frame's TOTAL_SIZE (from offset 0) or its CMD_SIZE (from offset 4)
_SIZE_AT: Final = struct.Struct(">I").unpack_from
#: frame types (the byte after a canonical command's ``08``) that :meth:`Telemetry.passed` may take
_DATA_PATH: Final = frozenset((T.SEND, T.SEND_RECEIPT))


class Telemetry:
    """The sans-IO core; see the module docstring."""

    def __init__(self, spans: SpanWriter | None = None, metrics: ProxyMetrics | None = None) -> None:
        self.spans = spans
        self.metrics = metrics
        self._timelines: dict[int, ConnectionTimeline] = {}
        self._peers: dict[int, Peer] = {}
        self.frames_seen = 0

    @property
    def connections(self) -> int:
        return len(self._timelines)

    def connection_opened(self, conn_id: int, ts_ns: int, client: str | None = None,
                          broker: str | None = None) -> None:
        if conn_id in self._timelines:
            return
        self._timelines[conn_id] = ConnectionTimeline(conn_id, inspect_trace_context=self.spans is not None)
        self._peers[conn_id] = Peer(client, broker)
        if self.spans is not None:
            self.spans.connection_opened(conn_id, self._peers[conn_id], ts_ns)
        if self.metrics is not None:
            self.metrics.active_connections += 1

    def frame(self, conn_id: int, direction: Direction, frame: Frame, received_ns: int, *,
              forwarded_ns: int | None = None, origin: str | None = None, fired: tuple[str, ...] = (),
              broker: str | None = None, marks: tuple[str, ...] = ()) -> None:
        """One frame crossed (``origin`` defaults to the sender its direction implies)."""
        self.frames_seen += 1
        if origin is None:
            origin = "client" if direction is _TO_BROKER else "broker"
        timeline = self._timelines.get(conn_id)
        if timeline is None:
            self.connection_opened(conn_id, received_ns, broker=broker)
            timeline = self._timelines[conn_id]
        if broker is not None and self._peers[conn_id].broker != broker:
            self._peers[conn_id] = Peer(self._peers[conn_id].client, broker)
            if self.spans is not None:
                self.spans.connection_routed(conn_id, self._peers[conn_id])
        if self.spans is None and self.metrics is None:
            return
        outcome = timeline.frame(frame, direction, origin, received_ns, forwarded_ns, fired, marks)
        if self.metrics is not None:
            command = type_name(frame.type)
            self.metrics.frame(command, direction.value, origin, frame.size)
            if outcome.messages:
                self.metrics.message_count(command, outcome.topic, outcome.messages)
            if fired:
                self.metrics.rules_fired(fired)
        self._publish(conn_id, outcome)

    def passed(self, conn_id: int, direction: Direction, raw: bytes, received_ns: int, forwarded_ns: int,
               origin: str, broker: str | None) -> bool:
        """:meth:`frame` of a passed-through SEND or SEND_RECEIPT, read without decoding; False: call frame().

        Only frames that the full path would account for in exactly this way take it
        (see :mod:`proxy.telemetry.data_path`): a known, connected connection on the
        same broker, the canonical encoding, no replicator, no trace context to read.
        """
        timeline = self._timelines.get(conn_id)
        if timeline is None or (broker is not None and self._peers[conn_id].broker != broker):
            return False
        metrics = self.metrics
        if direction is _TO_BROKER:
            fields = send_fields(raw)
            if fields is None or not timeline.fast_send_ready(fields[0]):
                return False
            cmd_end = 8 + int.from_bytes(raw[4:8], "big")
            if timeline.inspect_trace_context and len(raw) > cmd_end and (
                    TRACEPARENT_BYTES in raw or not searchable(raw, cmd_end, len(raw))):
                return False  # the full path reads the trace context (or rules it out the long way)
            self.frames_seen += 1
            producer_id, sequence_id, messages = fields
            topic = timeline.send(producer_id, sequence_id, messages, len(raw), received_ns, forwarded_ns, ())
            if metrics is not None:
                metrics.frame("SEND", direction.value, origin, len(raw))
                if messages:
                    metrics.message_count("SEND", topic, messages)
            return True
        receipt = receipt_fields(raw)
        if receipt is None or not timeline.connected:
            return False
        self.frames_seen += 1
        exchange = timeline.send_receipt(receipt[0], receipt[1], received_ns, forwarded_ns, origin)
        if metrics is not None:
            metrics.frame("SEND_RECEIPT", direction.value, origin, len(raw))
        if exchange is not None:
            self._publish_exchange(exchange, self._peers[conn_id])
        return True

    def passed_run(self, conn_id: int, direction: Direction, data: bytes | memoryview, pos: int, received_ns: int,
                   forwarded_ns: int, origin: str, broker: str | None) -> int:
        """:meth:`passed` (else :meth:`frame`) of each whole frame of ``data`` from ``pos``: where they end.

        SENDs and receipts in canonical encoding are accounted in bulk (see
        :mod:`proxy.telemetry.bulk`); any other frame goes the per-frame way, in its turn.
        """
        timeline = self._bulk_timeline(conn_id, broker)
        if timeline is None:
            return self._frames_one_by_one(conn_id, direction, data, pos, received_ns, forwarded_ns, origin, broker)
        if direction is _TO_BROKER:
            return self._sends(timeline, conn_id, data, pos, received_ns, forwarded_ns, origin, broker)
        return self._receipts(timeline, conn_id, data, pos, received_ns, forwarded_ns, origin, broker)

    def _bulk_timeline(self, conn_id: int, broker: str | None) -> ConnectionTimeline | None:
        """The connection's timeline when its SENDs and receipts may be accounted in bulk (it is known, of
        ``broker`` when one is named, and metrics or spans are on); else None: every frame the per-frame way."""
        timeline = self._timelines.get(conn_id)
        if timeline is None or (broker is not None and self._peers[conn_id].broker != broker) or (
                self.metrics is None and self.spans is None):
            return None
        return timeline

    def _sends(self, timeline: ConnectionTimeline, conn_id: int, data: bytes | memoryview, pos: int, received_ns: int,
               forwarded_ns: int, origin: str, broker: str | None) -> int:
        buf = _run_bytes(data)
        end_of_data, book = len(buf), timeline.book
        entries, other_keys = book.entries, book.other_keys
        inspect = timeline.inspect_trace_context
        # (one search of the run: in most runs no frame names a trace context)
        marked = inspect and buf.find(TRACEPARENT_BYTES, pos) >= 0
        trace_search = searchable if inspect else None  # (None: traces are off, nothing to look for)
        capacity, forgets = timeline.bulk_capacity() if timeline.connected else (0, False)
        producers: dict[bytes, tuple[bool, str | None]] = {}
        messages: dict[str | None, int] = {}
        while True:
            # the SENDs taken in bulk lie together from ``stretch`` to ``pos``
            stretch = pos
            pos, frames, capacity = take_sends(buf, pos, entries, other_keys, producers, timeline.bulk_producer,
                                               capacity, forgets, timeline.bulk_forget_oldest, received_ns,
                                               forwarded_ns, trace_search, marked, messages)
            self._count_sends(frames, pos - stretch, messages, origin)
            if end_of_data - pos < 8 or (end := pos + _SIZE_AT(buf, pos)[0] + 4) > end_of_data:
                return pos
            # another path for this one (what the stretch added up went first)
            messages = {}
            self._one_frame(conn_id, _TO_BROKER, buf[pos:end], received_ns, forwarded_ns, origin, broker)
            producers.clear()
            capacity, forgets = timeline.bulk_capacity() if timeline.connected and conn_id in self._timelines \
                else (0, False)
            pos = end

    def passed_send(self, conn_id: int, data: bytes | memoryview, received_ns: int, forwarded_ns: int,
                    broker: str | None) -> None:
        """:meth:`passed_run` of a run from the client that is one whole frame (from 0 to its end), without the
        run's walk: a SEND in bulk as :meth:`_sends` takes it, else the frame the per-frame way."""
        timeline = self._timelines.get(conn_id)
        # (what _bulk_timeline asks, asked here: a call less a message)
        if timeline is not None and timeline.connected and (self.metrics is not None or self.spans is not None) \
                and (broker is None or self._peers[conn_id].broker == broker):
            cmd_end = 8 + _SIZE_AT(data, 4)[0]
            found = send_command(data, 8, cmd_end)
            end = len(data)
            if found is not None and not (timeline.inspect_trace_context and end > cmd_end and (
                    _TRACEPARENT_IN(data) is not None or not searchable(data, cmd_end, end))):
                key, producer, number = found
                booked, topic = timeline.book_send(key, producer, received_ns, forwarded_ns, end, number)
                if booked:
                    self.frames_seen += 1
                    metrics = self.metrics
                    if metrics is not None:
                        metrics.send_passed(topic, end, number)
                    return
        self._one_frame(conn_id, _TO_BROKER, bytes(data), received_ns, forwarded_ns, "client", broker)

    def passed_receipt(self, conn_id: int, data: bytes | memoryview, received_ns: int, forwarded_ns: int,
                       broker: str | None) -> None:
        """:meth:`passed_run` of a run from the broker that is one whole frame (from 0 to its end), without the
        run's walk: a receipt in bulk as :meth:`_receipts` takes it, else the frame the per-frame way."""
        timeline = self._timelines.get(conn_id)
        spans, metrics = self.spans, self.metrics
        if timeline is not None and timeline.connected and (metrics is not None or spans is not None) \
                and (broker is None or self._peers[conn_id].broker == broker):
            key = receipt_key(data, 8, 8 + _SIZE_AT(data, 4)[0])
            book = timeline.book
            entries, other_keys = book.entries, book.other_keys
            if key is not None and not (other_keys and key in other_keys and key not in entries):
                entry = entries.pop(key, None)
                if entry is not None and spans is not None:
                    if spans.sample >= 1.0 or spans.draw() < spans.sample:
                        spans.sampled_exchange(timeline.bulk_exchange(key, entry, received_ns, forwarded_ns,
                                                                      "broker"), self._peers[conn_id])
                    else:
                        spans.spans_skipped += 1
                self.frames_seen += 1
                if metrics is not None:
                    if entry is None:
                        metrics.receipt_passed(None, len(data), None)
                    else:
                        metrics.receipt_passed(entry[4], len(data), forwarded_ns - entry[0])
                return
        self._one_frame(conn_id, _TO_CLIENT, bytes(data), received_ns, forwarded_ns, "broker", broker)

    def _count_sends(self, frames: int, size: int, messages: dict[str | None, int], origin: str) -> None:
        metrics = self._count_bulk(frames, size, "SEND", _TO_BROKER_LABEL, origin)
        if metrics is not None:
            for topic, count in messages.items():
                metrics.message_count("SEND", topic, count)

    def _count_bulk(self, frames: int, size: int, command: str, direction: str,
                    origin: str) -> ProxyMetrics | None:
        """Counts ``frames`` frames of ``size`` bytes taken in bulk (``direction``: its label value); the
        metrics for their per-topic figures."""
        if not frames:
            return None
        self.frames_seen += frames
        metrics = self.metrics
        if metrics is not None:
            metrics.frame(command, direction, origin, size, frames)
        return metrics

    def _receipts(self, timeline: ConnectionTimeline, conn_id: int, data: bytes | memoryview, pos: int,
                  received_ns: int, forwarded_ns: int, origin: str, broker: str | None) -> int:
        buf = _run_bytes(data)
        end_of_data, book, spans = len(buf), timeline.book, self.spans
        entries, other_keys = book.entries, book.other_keys
        # (spans.sampled() in the walk: drawn in the same order, a span built only for a sampled exchange)
        draw, rate = (spans.draw, spans.sample) if spans is not None else (None, 0.0)
        sampled: list[tuple[bytes, BookEntry]] = []
        bulk = timeline.connected
        while True:
            # the receipts taken in bulk lie together from ``stretch`` to ``pos``
            stretch, frames, skipped = pos, 0, 0
            latencies: dict[str | None, list[float]] = {}
            if bulk:
                pos, frames, skipped = take_receipts(buf, pos, entries, other_keys, forwarded_ns, latencies, draw,
                                                     rate, sampled)
                if sampled:
                    assert spans is not None
                    for key, entry in sampled:
                        spans.sampled_exchange(timeline.bulk_exchange(key, entry, received_ns, forwarded_ns, origin),
                                               self._peers[conn_id])
                    sampled.clear()
            self._count_receipts(frames, pos - stretch, latencies, origin, skipped)
            if end_of_data - pos < 8 or (end := pos + _SIZE_AT(buf, pos)[0] + 4) > end_of_data:
                return pos
            # another path for this one (what the stretch added up went first)
            self._one_frame(conn_id, _TO_CLIENT, buf[pos:end], received_ns, forwarded_ns, origin, broker)
            bulk = timeline.connected and conn_id in self._timelines
            pos = end

    def _count_receipts(self, frames: int, size: int, latencies: dict[str | None, list[float]], origin: str,
                        skipped: int) -> None:
        if skipped and self.spans is not None:
            self.spans.spans_skipped += skipped
        metrics = self._count_bulk(frames, size, "SEND_RECEIPT", _TO_CLIENT_LABEL, origin)
        if metrics is not None:
            for topic, seconds in latencies.items():
                metrics.requests("SEND", topic, "ok", seconds)

    def _frames_one_by_one(self, conn_id: int, direction: Direction, data: bytes | memoryview, pos: int,
                           received_ns: int, forwarded_ns: int, origin: str, broker: str | None) -> int:
        end_of_data, head = len(data), FRAME_HEAD.unpack_from
        while end_of_data - pos >= 8:
            end = pos + head(data, pos)[0] + 4
            if end > end_of_data:
                break
            self._one_frame(conn_id, direction, bytes(data[pos:end]), received_ns, forwarded_ns, origin, broker)
            pos = end
        return pos

    def _one_frame(self, conn_id: int, direction: Direction, raw: bytes, received_ns: int, forwarded_ns: int,
                   origin: str, broker: str | None) -> None:
        """A passed-through frame the per-frame way: :meth:`passed`, else decoded for :meth:`frame`."""
        if raw[9] in _DATA_PATH and self.passed(conn_id, direction, raw, received_ns, forwarded_ns, origin, broker):
            return
        frame = _passed_frame(raw)
        if frame is not None:
            self.frame(conn_id, direction, frame, received_ns, forwarded_ns=forwarded_ns, origin=origin,
                       broker=broker)

    def permits(self, conn_id: int) -> dict[int, int]:
        """consumer id -> outstanding FLOW permits on one connection, as the permits gauge counts them."""
        timeline = self._timelines.get(conn_id)
        return {} if timeline is None else timeline.permits_by_consumer()

    def connection_closed(self, conn_id: int, ts_ns: int, reason: str | None = None) -> None:
        timeline = self._timelines.pop(conn_id, None)
        if timeline is None:
            return
        self._publish(conn_id, timeline.close(ts_ns))
        self._peers.pop(conn_id, None)
        if self.spans is not None:
            self.spans.connection_closed(conn_id, ts_ns, reason)
        if self.metrics is not None:
            self.metrics.active_connections -= 1

    def close(self, ts_ns: int) -> None:
        """Stop: every open connection ends (its pending requests unanswered)."""
        for conn_id in list(self._timelines):
            self.connection_closed(conn_id, ts_ns, "telemetry stopped")

    def _publish(self, conn_id: int, outcome: FrameOutcome) -> None:
        peer = self._peers.get(conn_id, Peer())
        metrics, spans = self.metrics, self.spans
        for exchange in outcome.exchanges:
            self._publish_exchange(exchange, peer)
        if spans is not None:
            for cycle in outcome.cycles:
                spans.delivery(cycle, peer)
            if outcome.loose_rules:
                spans.loose_rules(conn_id, outcome.loose_rules)
        if metrics is not None:
            if outcome.producers_delta:
                metrics.producers += outcome.producers_delta
            if outcome.consumers_delta:
                metrics.consumers += outcome.consumers_delta
            if outcome.permits_delta:
                metrics.outstanding_permits += outcome.permits_delta

    def _publish_exchange(self, exchange: Exchange, peer: Peer) -> None:
        if self.metrics is not None:
            self.metrics.request(exchange.command, exchange.pair.topic, exchange.pair.outcome,
                                 exchange.duration_ns / 1e9)
        if self.spans is not None:
            self.spans.exchange(exchange, peer)


def _run_bytes(data: bytes | memoryview) -> bytes:
    """A run's bytes: the compiled walks read ``bytes`` natively (a view's copy, once a run, costs less than
    copying each command out of it)."""
    return data if type(data) is bytes else bytes(data)


def _broker_of(connection: ConnectionInfo) -> str | None:
    return connection.broker_url


class TelemetryObserver:
    """:class:`Telemetry` behind the proxy's observer hook."""

    #: telemetry pairs requests with its own tracker (it also sees the proxy's frames)
    needs_observation = False
    #: each run is cut into frames and each frame worked on: long runs come in pieces
    runs_in_pieces = True
    #: a run's ``data`` may be a view the hub reuses once ``on_run`` returns: nothing of it is kept but
    #: copies (the cutter's carry, a frame's ``bytes``)
    run_views = True

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        #: per (connection, direction): the runs cut back into frames
        self._cutters: dict[tuple[int, Direction], RunCutter] = {}

    @property
    def frames_lost(self) -> int:
        """Frames of open connections that dropped runs cut (neither whole nor observed)."""
        return sum(cutter.lost for cutter in self._cutters.values())

    def on_connection(self, event: ConnectionEvent) -> None:
        info = event.connection
        if event.closed:
            self._cutters.pop((info.conn_id, _TO_BROKER), None)
            self._cutters.pop((info.conn_id, _TO_CLIENT), None)
            self.telemetry.connection_closed(info.conn_id, event.ts_ns, event.reason)
        else:
            self.telemetry.connection_opened(info.conn_id, event.ts_ns, info.client, _broker_of(info))

    def on_frame(self, event: FrameEvent) -> None:
        self.telemetry.frame(event.connection.conn_id, event.direction, event.frame, event.ts_ns,
                             forwarded_ns=event.forwarded_ns, origin=event.origin.value, fired=event.fired,
                             broker=_broker_of(event.connection), marks=event.marks)

    def on_run(self, event: RunEvent) -> None:
        """Frames passed through unchanged: each as a FrameEvent of its own would tell.

        A run that is one whole frame (a SEND or a receipt read alone, while the relay reads frames
        as fast as they come) goes to :meth:`Telemetry.passed_send` / :meth:`Telemetry.passed_receipt`,
        which do what :meth:`Telemetry.passed_run` does with it without walking a run.
        """
        conn_id, direction, data = event.connection.conn_id, event.direction, event.data
        cutter = self._cutters.get((conn_id, direction))
        if cutter is None:
            cutter = self._cutters[(conn_id, direction)] = RunCutter()
        size = len(data)
        if size >= 8 and _SIZE_AT(data)[0] + 4 == size and cutter.passes_whole(event.lead, event.stream_pos,
                                                                                  size):
            if direction is _TO_BROKER:
                self.telemetry.passed_send(conn_id, data, event.ts_ns, event.forwarded_ns,
                                           event.connection.broker_url)
            else:
                self.telemetry.passed_receipt(conn_id, data, event.ts_ns, event.forwarded_ns,
                                              event.connection.broker_url)
            return
        completed, pos = cutter.begin(data, event.lead, event.stream_pos)
        telemetry, broker = self.telemetry, _broker_of(event.connection)
        origin = "client" if direction is _TO_BROKER else "broker"
        if completed is not None:
            telemetry.passed_run(conn_id, direction, completed, 0, event.ts_ns, event.forwarded_ns, origin, broker)
        cutter.end(data, telemetry.passed_run(conn_id, direction, data, pos, event.ts_ns, event.forwarded_ns,
                                              origin, broker))


def _passed_frame(raw: bytes) -> Frame | None:
    """A Frame of bytes the relay checked and passed (its type read from the canonical ``08 TYPE``)."""
    cmd_size = int.from_bytes(raw[4:8], "big")
    if raw[8] == 0x08 and raw[9] < 0x80:
        return Frame(raw, raw[9], cmd_size)
    try:
        return Frame(raw, peek_type(raw, 8, 8 + cmd_size), cmd_size)
    except ProtocolError:
        return None
