"""The second step of ``analyze``: one connection's edge rows, from every split, in capture order.

The first step (:mod:`proxy.analytics.decode`) leaves, per connection, a few rows it
could not finish alone (:data:`~proxy.analytics.tables.EDGE`).  Here they are taken in
capture order through the connection's :class:`~proxy.protocol.session.SessionTracker`
— the same machine ``show`` and the live tracer run — which gives:

- the ``frames`` rows of control frames, and the ``requests`` they pair;
- SENDs paired with their SEND_RECEIPT / SEND_ERROR as the tracker pairs them (by
  producer id and sequence id; a SEND sent again with the same ids replaces the one
  still waiting), with the topic the producer had when the SEND left — on whole
  columns (:func:`send_requests`), as they are most of the rows that come here;
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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from proxy.analytics import tables as tb
from proxy.analytics.decode import SEND, SEND_ERROR, ChunkAssembler, message_values, unread_batch_values
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import chunks, compression
from proxy.protocol.frame import Frame, frame_from_bytes
from proxy.protocol.session import Direction, RequestPair, SessionTracker, batch_spans

if TYPE_CHECKING:
    import pyarrow as pa

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
    #: each connection's last capture time
    last_ts: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ConnectionTables:
    """What the second step makes of some connections: output tables, and the topic answers."""

    frames: pa.Table
    requests: pa.Table
    messages: pa.Table
    errors: pa.Table
    resolution: list[Row]


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
        self.assembler = ChunkAssembler()
        self.last_ts = 0

    def run(self, rows: Iterable[dict[str, Any]]) -> None:
        handlers = {tb.EDGE_CONTROL: self._control, tb.EDGE_REF: self._ref,
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
        values: list[tuple[Any, ...]] = []
        if metadata.HasField("num_messages_in_batch") and not metadata.encryption_keys:
            values = unread_batch_values(metadata.sequence_id, metadata.num_messages_in_batch)
        else:
            if metadata.compression != compression.NONE and not metadata.encryption_keys:
                # The payload is not here to inflate: its size is what the metadata says it inflates to.
                metadata.compression = compression.NONE
                whole = chunks.AssembledMessage(metadata, bytes(metadata.uncompressed_size), whole.num_chunks,
                                                whole.uuid)
            message_values(metadata, whole.payload, values)
        for sequence_id, size, key, properties_count, batch_index, event_time in values:
            self.out.messages.append((self.recording, self.conn_id, ts_ns, topic, last.producer_name, sequence_id,
                                      publish_time, size, compression_name, key, properties_count, batch_index,
                                      event_time))

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
        self.out.last_ts.append((self.recording, self.conn_id, self.last_ts))


def send_requests(sends: pa.Table, resolution: pa.Table, last_ts: pa.Table, window: TimeWindow) -> pa.Table:
    """The ``requests`` rows of SENDs, from the :data:`~proxy.analytics.tables.EDGE` rows of SENDs and receipts.

    What the tracker does one frame at a time (a SEND waits under its producer and
    sequence id; a later SEND with the same ids replaces it; a receipt or SEND_ERROR
    answers the one waiting, or nothing) is, per ids, a look at the next event with
    the same ids: a SEND followed by an answer is answered by it, one followed by
    another SEND was replaced (no row), and the last one is ``unanswered`` at the
    connection's last capture time.  ``resolution`` gives the topic at the SEND's
    epoch; ``last_ts`` is ``(recording, conn_id, last_ts)``.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = tb.arrow_schema(tb.TABLES["requests"])
    if not sends.num_rows:
        return schema.empty_table()
    keys = ["recording", "conn_id", "producer_id", "sequence_id"]
    sends = sends.select([*keys, "seq", "ts_ns", "frame_type", "num_messages", "error_code", "error_message",
                          "epoch"]).join(last_ts, keys=["recording", "conn_id"], join_type="left outer",
                                         use_threads=False)
    sends = _batch_answers_under_first_ids(sends, keys)
    sends = sends.sort_by([(name, "ascending") for name in (*keys, "seq")]).combine_chunks()
    count = sends.num_rows
    same_as_next = np.zeros(count, dtype=bool)
    if count > 1:
        equal = np.ones(count - 1, dtype=bool)
        for name in keys:
            column = sends[name]
            equal &= pc.fill_null(pc.equal(column.slice(0, count - 1), column.slice(1)), False).to_numpy()
        same_as_next[:-1] = equal
    frame_type = sends["frame_type"].to_numpy()
    next_type = np.append(frame_type[1:], -1)
    answered = same_as_next & (next_type != SEND)
    kept = np.nonzero((frame_type == SEND) & (answered | ~same_as_next))[0]
    answered = answered[kept]
    answer = pa.array(np.where(answered, kept + 1, kept))  # the answer's row, where there is one

    def take(name: str, rows: Any = kept) -> Any:
        return sends[name].take(rows)

    is_answered = pa.array(answered)
    is_error = pc.equal(take("frame_type", answer), SEND_ERROR)
    start_ns = take("ts_ns")
    end_ns = pc.if_else(is_answered, take("ts_ns", answer), take("last_ts"))
    no_text = pa.scalar(None, pa.string())
    table = pa.table({
        "recording": take("recording"), "conn_id": take("conn_id"),
        "request_command": pa.array(["SEND"] * len(kept), pa.string()),
        "response_command": pc.if_else(is_answered, pc.if_else(is_error, "SEND_ERROR", "SEND_RECEIPT"), no_text),
        "start_ns": start_ns, "end_ns": end_ns,
        "latency_us": pc.divide(pc.subtract(end_ns, start_ns).cast(pa.float64()), 1000.0),
        "outcome": pc.if_else(is_answered, pc.if_else(is_error, "error", "ok"), "unanswered"),
        "error_code": pc.if_else(is_answered, take("error_code", answer), no_text),
        "error_message": pc.if_else(is_answered, take("error_message", answer), no_text),
        "request_id": pa.nulls(len(kept), pa.int64()), "producer_id": take("producer_id"),
        "consumer_id": pa.nulls(len(kept), pa.int64()), "sequence_id": take("sequence_id"),
        "num_messages": take("num_messages"),
        "epoch": take("epoch"), "ref_kind": pa.array([tb.REF_PRODUCER] * len(kept), pa.int32()),
        "ref_id": take("producer_id"),
    })
    if window.since_ns is not None:
        table = table.filter(pc.greater_equal(table["start_ns"], window.since_ns))
    if window.until_ns is not None:
        table = table.filter(pc.less(table["start_ns"], window.until_ns))
    table = table.join(resolution, keys=["recording", "conn_id", "epoch", "ref_kind", "ref_id"],
                       join_type="left outer", use_threads=False)
    return table.select(schema.names).cast(schema)


def _batch_answers_under_first_ids(sends: pa.Table, keys: list[str]) -> pa.Table:
    """``sends`` with every SEND_ERROR that answers a batch under a later id than its first (a broker refusing
    a transactional batch answers under its highest sequence id) moved to the batch's first id, as the
    tracker pairs it: the latest SEND before it, of its producer, whose messages' sequence ids span its id.
    Rare, so looked for only among errors that match no SEND's ids."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    is_error = pc.equal(sends["frame_type"], SEND_ERROR)
    if not pc.any(is_error).as_py() or sends["sequence_id"].null_count:
        return sends
    sends = sends.append_column("_row", pa.array(np.arange(sends.num_rows)))
    send_rows = sends.filter(pc.equal(sends["frame_type"], SEND))
    first_ids = send_rows.select(keys).group_by(keys).aggregate([])
    lost = sends.filter(is_error).join(first_ids, keys=keys, join_type="left anti", use_threads=False)
    if not lost.num_rows:
        return sends.drop_columns(["_row"])
    producers = keys[:-1]
    lost_producers = lost.select(producers).group_by(producers).aggregate([])
    spans: dict[tuple[Any, ...], list[tuple[int, int, int | None]]] = {}
    for row in send_rows.join(lost_producers, keys=producers, join_type="inner", use_threads=False).to_pylist():
        spans.setdefault(tuple(row[name] for name in producers), []).append(
            (row["seq"], row["sequence_id"], row["num_messages"]))
    moved = sends["sequence_id"].to_numpy(zero_copy_only=False).copy()
    for error in lost.to_pylist():
        spanning = [(seq, first) for seq, first, count in spans.get(tuple(error[name] for name in producers), [])
                    if seq < error["seq"] and batch_spans(first, count, error["sequence_id"])]
        if spanning:
            moved[error["_row"]] = max(spanning)[1]
    at = sends.schema.get_field_index("sequence_id")
    return sends.set_column(at, sends.schema.field(at), pa.array(moved, sends.schema.field(at).type)).drop_columns(
        ["_row"])


def _by_connection(edges: pa.Table) -> dict[tuple[str, int], list[dict[str, Any]]]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in edges.to_pylist():
        groups.setdefault((row["recording"], row["conn_id"]), []).append(row)
    return groups


def finish_connections(edges: pa.Table, window: TimeWindow, others: pa.Table | None = None) -> ConnectionTables:
    """Finish every connection whose edge rows are in ``edges`` (an Arrow table, any row order).

    ``others``, edge rows of connections finished elsewhere (SEND rows not needed), only
    adds their topic answers to :attr:`ConnectionTables.resolution`: their control frames
    go through the session machine, nothing else is done with them and no rows are made.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from proxy.analytics.output import resolution_table, rows_table

    out = ConnectionRows()
    is_send = pc.equal(edges["edge"], tb.EDGE_SEND)
    for (recording, conn_id), rows in _by_connection(edges.filter(pc.invert(is_send))).items():
        ConnectionFinisher(recording, conn_id, out, window).run(rows)
    if others is not None:
        answering = others.filter(pc.is_in(others["edge"], pa.array([tb.EDGE_CONTROL, tb.EDGE_REF], pa.int32())))
        for (recording, conn_id), rows in _by_connection(answering).items():
            elsewhere = ConnectionRows()  # (made by the connection's own finisher)
            ConnectionFinisher(recording, conn_id, elsewhere, window).run(rows)
            out.resolution += elsewhere.resolution
    last_ts = pa.table({"recording": pa.array([r for r, _, _ in out.last_ts], pa.string()),
                        "conn_id": pa.array([c for _, c, _ in out.last_ts], pa.int64()),
                        "last_ts": pa.array([t for _, _, t in out.last_ts], pa.int64())})
    sends = send_requests(edges.filter(is_send), resolution_table(out.resolution), last_ts, window)
    requests = pa.concat_tables([rows_table("requests", out.requests), sends])
    failed = sends.filter(pc.not_equal(sends["outcome"], "ok"))
    failed = failed.select(["recording", "conn_id", "start_ns", "request_command", "topic", "outcome", "error_code",
                            "error_message"]).rename_columns(tb.names(tb.TABLES["errors"]))
    errors = pa.concat_tables([rows_table("errors", out.errors), failed])
    return ConnectionTables(rows_table("frames", out.frames), requests, rows_table("messages", out.messages),
                            errors, out.resolution)


__all__ = ["ConnectionFinisher", "ConnectionRows", "ConnectionTables", "TimeWindow", "finish_connections",
           "send_requests"]
