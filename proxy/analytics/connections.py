"""The second step of ``analyze``: one connection's edge rows, from every split, in capture order.

The first step (:mod:`proxy.analytics.decode`) leaves, per connection, a few rows it
could not finish alone (:data:`~proxy.analytics.tables.EDGE`).  Here they are taken in
capture order through the connection's :class:`~proxy.protocol.session.SessionTracker`
— the same machine ``show`` and the live tracer run — which gives:

- the ``frames`` rows of control frames, and the ``requests`` they pair;
- SENDs paired with their SEND_RECEIPT / SEND_ERROR as the tracker pairs them (by
  producer id and sequence id; a SEND sent again with the same ids replaces the one
  still waiting), with the topic the producer had when the SEND left;
- the topic of every producer and consumer id at each epoch the first step asked
  about (:data:`~proxy.analytics.tables.RESOLUTION`);
- chunked messages whose chunks fell into several splits, reassembled from their
  chunks' metadata (sizes only: their payload stays where it was read, so the row's
  ``size`` is the metadata's ``uncompressed_size``; a batch inside a chunked message —
  something Pulsar clients refuse to send — gets one row per message with unknown sizes,
  as for a recording without payloads);
- requests still waiting when the connection's last frame was seen, as ``unanswered``;
- the ``errors`` rows: failed and unanswered requests, and frames that did not decode.

Two bounds of the live tracker do not apply here, because a recording is analysed
whole: SENDs waiting for a receipt are never forgotten (the tracker keeps 65 536
requests per connection), and nor are chunked messages being assembled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.analytics import tables as tb
from proxy.analytics.decode import SEND, SEND_ERROR, ChunkAssembler, message_rows
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import chunks, compression
from proxy.protocol.frame import Frame, frame_from_bytes
from proxy.protocol.session import Direction, RequestPair, SessionTracker

Row = tuple[Any, ...]
_ID_FIELDS: Final = ("request_id", "producer_id", "consumer_id", "sequence_id")
_EDGE_COLUMNS: Final = tb.names(tb.EDGE)


@dataclass(slots=True)
class ConnectionRows:
    """Rows of the output tables for one or several connections (tuples in :data:`TABLES` column order)."""

    frames: list[Row] = field(default_factory=list)
    requests: list[Row] = field(default_factory=list)
    messages: list[Row] = field(default_factory=list)
    errors: list[Row] = field(default_factory=list)
    resolution: list[Row] = field(default_factory=list)


@dataclass(slots=True)
class _PendingSend:
    start_ns: int
    topic: str | None
    num_messages: int


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """``--since`` / ``--until``: only rows at or after ``since`` and before ``until`` are kept."""

    since_ns: int | None = None
    until_ns: int | None = None

    def keeps(self, ts_ns: int) -> bool:
        return (self.since_ns is None or ts_ns >= self.since_ns) and (self.until_ns is None or ts_ns < self.until_ns)


def _request_row(recording: str, conn_id: int, pair: RequestPair) -> Row:
    return (recording, conn_id, pair.request_command, pair.response_command, pair.topic, pair.start_ns, pair.end_ns,
            pair.latency_ns / 1000.0, pair.outcome, pair.error_code, pair.error_message, pair.request_id,
            pair.producer_id, pair.consumer_id, pair.sequence_id, pair.num_messages)


def _control_frame_row(recording: str, conn_id: int, ts_ns: int, direction: str, origin: str, size: int,
                       frame: Frame, topic: str | None, rules: str | None) -> Row:
    sub: Any = frame.sub
    fields = sub.DESCRIPTOR.fields_by_name
    ids = [getattr(sub, name) if name in fields and sub.HasField(name) else None for name in _ID_FIELDS]
    return (recording, conn_id, ts_ns, direction, origin, frame.type_name, size, topic, *ids, None, None, rules)


class ConnectionFinisher:
    """Finishes one connection from its edge rows; see the module docstring."""

    def __init__(self, recording: str, conn_id: int, out: ConnectionRows, window: TimeWindow) -> None:
        self.recording = recording
        self.conn_id = conn_id
        self.out = out
        self.window = window
        self.tracker = SessionTracker(strict=False)
        self.sends: OrderedDict[tuple[int, int], _PendingSend] = OrderedDict()
        self.assembler = ChunkAssembler()
        self.last_ts = 0

    def run(self, rows: Iterable[dict[str, Any]]) -> None:
        handlers = {tb.EDGE_CONTROL: self._control, tb.EDGE_SEND: self._send, tb.EDGE_REF: self._ref,
                    tb.EDGE_CHUNK: self._chunk, tb.EDGE_CHUNK_RESET: self._chunk_reset,
                    tb.EDGE_PROBLEM: self._problem, tb.EDGE_LAST: self._last}
        for row in sorted(rows, key=lambda r: (r["seq"], r["edge"])):
            handlers[row["edge"]](row)
        self._close()

    # -- the rows ---------------------------------------------------------------------------
    def _control(self, row: dict[str, Any]) -> None:
        ts_ns, direction = row["ts_ns"], row["direction"]
        try:
            frame = frame_from_bytes(row["data"], max(row["size"], 8), strict=False)  # recordings: lenient
            obs = self.tracker.observe(frame, Direction(direction), ts_ns)
            if self.window.keeps(ts_ns):
                self.out.frames.append(_control_frame_row(self.recording, self.conn_id, ts_ns, direction,
                                                          row["origin"], row["size"], frame, obs.topic, row["rules"]))
            if obs.completed is not None:
                self._request(obs.completed)
        except (ProtocolError, ValueError) as exc:
            self._add_problem(ts_ns, direction, f"{type(exc).__name__}: {exc}")

    def _topic(self, ref_kind: int, ref_id: int) -> str | None:
        owner = (self.tracker.producers if ref_kind == tb.REF_PRODUCER else self.tracker.consumers).get(ref_id)
        return owner.topic if owner is not None else None

    def _send(self, row: dict[str, Any]) -> None:
        key = (row["producer_id"], row["sequence_id"])
        if row["frame_type"] == SEND:
            self.sends[key] = _PendingSend(row["ts_ns"], self._topic(tb.REF_PRODUCER, key[0]), row["num_messages"])
            return
        pending = self.sends.pop(key, None)
        if pending is None:
            return
        failed = row["frame_type"] == SEND_ERROR
        self._request(RequestPair(
            SEND, row["frame_type"], pending.start_ns, row["ts_ns"], pending.topic, "error" if failed else "ok",
            row["error_code"], row["error_message"], producer_id=key[0], sequence_id=key[1],
            num_messages=pending.num_messages))

    def _ref(self, row: dict[str, Any]) -> None:
        self.out.resolution.append((self.recording, self.conn_id, row["seq"], row["ref_kind"], row["ref_id"],
                                    self._topic(row["ref_kind"], row["ref_id"])))

    def _chunk(self, row: dict[str, Any]) -> None:
        ts_ns = row["ts_ns"]
        try:
            metadata = api.MessageMetadata.FromString(row["data"])
            whole = self.assembler.add(metadata, bytes(row["payload_size"]))
            if whole is not None and self.window.keeps(ts_ns):
                self._spanning_message(ts_ns, metadata, whole, self._topic(tb.REF_PRODUCER, row["producer_id"]))
        except (ProtocolError, ValueError) as exc:
            self._add_problem(ts_ns, row["direction"], f"{type(exc).__name__}: {exc}")

    def _spanning_message(self, ts_ns: int, last: api.MessageMetadata, whole: chunks.AssembledMessage,
                          topic: str | None) -> None:
        publish_time, compression_name = last.publish_time, compression.compression_name(last.compression)
        metadata = whole.metadata
        staged: list[tuple[Any, ...]] = []
        if metadata.HasField("num_messages_in_batch") and not metadata.encryption_keys:
            count = metadata.num_messages_in_batch
            staged = [(self.conn_id, ts_ns, last.producer_name, metadata.sequence_id + i, publish_time, None,
                       compression_name, None, None, i if count > 1 else -1, None) for i in range(count)]
        else:
            if metadata.compression != compression.NONE and not metadata.encryption_keys:
                # The payload is not here to inflate: its size is what the metadata says it inflates to.
                metadata.compression = compression.NONE
                whole = chunks.AssembledMessage(metadata, bytes(metadata.uncompressed_size), whole.num_chunks,
                                                whole.uuid)
            message_rows(metadata, whole.payload, staged, self.conn_id, ts_ns, last.producer_name, publish_time,
                         compression_name, None, None, None)
        for row in staged:
            self.out.messages.append((self.recording, row[0], row[1], topic, *row[2:11]))

    def _chunk_reset(self, row: dict[str, Any]) -> None:
        producer_name, uuid = row["message"].split("\x00", 1)
        self.assembler.forget((producer_name, uuid))

    def _problem(self, row: dict[str, Any]) -> None:
        self._add_problem(row["ts_ns"], row["direction"], row["message"])

    def _last(self, row: dict[str, Any]) -> None:
        self.last_ts = max(self.last_ts, row["ts_ns"])

    # -- output -----------------------------------------------------------------------------
    def _request(self, pair: RequestPair) -> None:
        if not self.window.keeps(pair.start_ns):
            return
        self.out.requests.append(_request_row(self.recording, self.conn_id, pair))
        if pair.outcome != "ok":
            self.out.errors.append((self.recording, self.conn_id, pair.start_ns, pair.request_command, pair.topic,
                                    pair.outcome, pair.error_code, pair.error_message))

    def _add_problem(self, ts_ns: int, direction: str, message: str) -> None:
        if self.window.keeps(ts_ns):
            self.out.errors.append((self.recording, self.conn_id, ts_ns, None, None, "undecodable", "DecodeError",
                                    message))
            del direction  # the reference's "where" is not a column of the errors table

    def _close(self) -> None:
        for pair in self.tracker.close(self.last_ts):
            self._request(pair)
        for (producer_id, sequence_id), pending in self.sends.items():
            self._request(RequestPair(SEND, None, pending.start_ns, self.last_ts, pending.topic, "unanswered",
                                      producer_id=producer_id, sequence_id=sequence_id,
                                      num_messages=pending.num_messages))
        self.sends.clear()


def finish_connections(edges: Any, window: TimeWindow, out: ConnectionRows | None = None) -> ConnectionRows:
    """Finish every connection whose edge rows are in ``edges`` (an Arrow table, any row order)."""
    out = out or ConnectionRows()
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in edges.to_pylist():
        groups.setdefault((row["recording"], row["conn_id"]), []).append(row)
    for (recording, conn_id), rows in groups.items():
        ConnectionFinisher(recording, conn_id, out, window).run(rows)
    return out


__all__ = ["ConnectionFinisher", "ConnectionRows", "TimeWindow", "finish_connections"]
