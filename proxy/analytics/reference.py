"""The sequential reference for ``analyze``: every connection through the session machine, one frame at a time.

This is how the pipeline worked before it was made to scale (one connection's frames
gathered in capture order, then decoded and paired in one go), kept as the
specification the fast path is held to: the tests compare
:func:`reference_tables` with the tables ``analyze`` writes, row for row, and
``bench/analyze.py`` measures the fast path's frames per second against it.  It reads
segments with the same damage-skipping reader as the pipeline
(:class:`~proxy.analytics.segments.SplitReader`).

Nothing here imports Spark.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from proxy.analytics.segments import Split, SplitReader, segment_index, segment_recording_id
from proxy.analytics.tables import PROBLEM_COLUMNS
from proxy.analytics.tables import TABLES as OUTPUT
from proxy.errors import ProtocolError
from proxy.protocol import chunks, compression, markers
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame
from proxy.protocol.message import decode_messages
from proxy.protocol.session import Direction, RequestPair, SessionTracker
from proxy.recording.reader import frame_from_record

#: The tables the reference fills (``errors`` and ``throughput`` are derived from them).
TABLES: Final = {**{name: OUTPUT[name] for name in ("frames", "requests", "messages", "replication")},
                 "problems": PROBLEM_COLUMNS}


def empty_columns(columns: Iterable[tuple[str, str]]) -> dict[str, list[Any]]:
    return {name: [] for name, _ in columns}


def _append(cols: dict[str, list[Any]], row: dict[str, Any]) -> None:
    for name, values in cols.items():
        values.append(row.get(name))


def segment_frames(recording: str, segment: str, content: bytes) -> list[tuple[int, int, tuple[Any, ...]]]:
    """``(conn_id, position, (ts_ns, direction, origin, size, data, payload_stripped, rules))`` per frame record.

    ``recording`` is the directory's name unless the segment's header names another.
    """
    split = Split(0, recording, segment, segment_index(segment), segment, 0, len(content), len(content))
    out = []
    for offset, record in SplitReader(content, split).records():
        if record.HasField("header"):
            recording = record.header.recording_id or recording
            continue
        if not record.HasField("frame"):
            continue
        rec = frame_from_record(record.frame, recording)
        out.append((rec.conn, offset, (rec.ts_ns, rec.direction, rec.origin, rec.size, rec.data,
                                       rec.payload_stripped, ",".join(rec.rules) or None)))
    return out


@dataclass(slots=True)
class ConnectionTables:
    """Rows of every output table for one connection, as column lists."""

    tables: dict[str, dict[str, list[Any]]] = field(
        default_factory=lambda: {name: empty_columns(cols) for name, cols in TABLES.items()})

    def add(self, table: str, row: dict[str, Any]) -> None:
        _append(self.tables[table], row)


def _request_row(recording: str, conn_id: int, pair: RequestPair) -> dict[str, Any]:
    return {
        "recording": recording, "conn_id": conn_id, "request_command": pair.request_command,
        "response_command": pair.response_command, "topic": pair.topic, "start_ns": pair.start_ns,
        "end_ns": pair.end_ns, "latency_us": pair.latency_ns / 1000.0, "outcome": pair.outcome,
        "error_code": pair.error_code, "error_message": pair.error_message, "request_id": pair.request_id,
        "producer_id": pair.producer_id, "consumer_id": pair.consumer_id, "sequence_id": pair.sequence_id,
        "num_messages": pair.num_messages,
    }


_ID_FIELDS: Final = ("request_id", "producer_id", "consumer_id", "sequence_id")


def _frame_row(recording: str, conn_id: int, ts_ns: int, direction: str, origin: str, size: int,
               frame: Frame, topic: str | None, rules: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"recording": recording, "conn_id": conn_id, "ts_ns": ts_ns, "direction": direction,
                           "origin": origin, "command": frame.type_name, "size": size, "topic": topic,
                           "rules": rules}
    sub: Any = frame.sub
    fields = sub.DESCRIPTOR.fields_by_name
    for name in _ID_FIELDS:
        if name in fields and sub.HasField(name):
            row[name] = getattr(sub, name)
    if frame.type == T.SEND:
        row["num_messages"] = sub.num_messages if sub.HasField("num_messages") else 1
    section = frame.payload
    if section is not None:
        row["payload_size"] = len(section.payload)
        if frame.type == T.MESSAGE:
            metadata = section.metadata
            row["num_messages"] = metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else 1
    return row


class _MessageDecoder:
    """Produced messages of one connection: chunks reassembled, batches split."""

    def __init__(self) -> None:
        self.assembler = chunks.ChunkAssembler()

    def rows(self, recording: str, conn_id: int, ts_ns: int, topic: str | None, frame: Frame,
             stripped: bool) -> list[dict[str, Any]]:
        section = frame.payload
        if section is None:
            return []
        metadata, payload = section.metadata, section.payload
        base = {"recording": recording, "conn_id": conn_id, "ts_ns": ts_ns, "topic": topic,
                "producer_name": metadata.producer_name, "publish_time_ms": metadata.publish_time,
                "compression": compression.compression_name(metadata.compression)}
        if markers.is_marker(metadata):
            return []
        if chunks.is_chunk(metadata):
            if stripped:
                return [] if metadata.chunk_id + 1 < metadata.num_chunks_from_msg else [
                    {**base, "sequence_id": metadata.sequence_id, "size": metadata.total_chunk_msg_size,
                     "batch_index": -1}]
            whole = self.assembler.add(metadata, payload)
            if whole is None:
                return []
            metadata, payload = whole.metadata, whole.payload
        if stripped:
            # Payload bytes were not recorded: one row per message, sizes unknown inside a batch.
            count = metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else 1
            return [{**base, "sequence_id": metadata.sequence_id + i, "size": None,
                     "batch_index": i if count > 1 else -1, "properties_count": None} for i in range(count)]
        return [{
            **base, "sequence_id": message.sequence_id, "size": message.size, "key": message.key,
            "properties_count": len(message.properties), "batch_index": message.batch_index,
            "event_time_ms": message.event_time or None,
        } for message in decode_messages(metadata, payload)]


def _replication_rows(recording: str, conn_id: int, ts_ns: int, direction: str, topic: str | None,
                      frame: Frame, stripped: bool) -> list[dict[str, Any]]:
    section = frame.payload
    if section is None:
        return []
    metadata = section.metadata
    base = {"recording": recording, "conn_id": conn_id, "ts_ns": ts_ns, "direction": direction, "topic": topic,
            "publish_time_ms": metadata.publish_time}
    rows = []
    if metadata.HasField("replicated_from"):
        rows.append({**base, "kind": "replicated_message", "replicated_from": metadata.replicated_from,
                     "lag_ms": ts_ns / 1e6 - metadata.publish_time})
    if markers.is_marker(metadata) and not stripped:
        payload = compression.decompress(metadata.compression, section.payload, metadata.uncompressed_size)
        marker = markers.decode_marker(metadata, payload)
        body = marker.body
        rows.append({**base, "kind": marker.name, "replicated_from": metadata.replicated_from or None,
                     "snapshot_id": getattr(body, "snapshot_id", None) if body is not None else None,
                     "source_cluster": getattr(body, "source_cluster", None) or None})
    return rows


def connection_tables(recording: str, conn_id: int, frames: Iterable[tuple[int, str, str, int, bytes, bool,
                                                                            str | None]]) -> ConnectionTables:
    """Every output row for one connection.

    ``frames`` are ``(ts_ns, direction, origin, size, data, payload_stripped, rules)``
    in capture order.  A frame that does not decode becomes a ``problems`` row and
    is otherwise skipped; pending requests end ``unanswered`` at the end.
    """
    out = ConnectionTables()
    tracker = SessionTracker(strict=False)
    messages = _MessageDecoder()
    last_ts = 0
    for ts_ns, direction, origin, size, data, stripped, rules in frames:
        last_ts = max(last_ts, ts_ns)
        try:
            rec = frame_from_record_fields(data, size, stripped)
            obs = tracker.observe(rec, Direction(direction), ts_ns)
            out.add("frames", _frame_row(recording, conn_id, ts_ns, direction, origin, size, rec, obs.topic, rules))
            if obs.completed is not None:
                out.add("requests", _request_row(recording, conn_id, obs.completed))
            if rec.type in (T.SEND, T.MESSAGE):
                if rec.type == T.SEND:
                    for row in messages.rows(recording, conn_id, ts_ns, obs.topic, rec, stripped):
                        out.add("messages", row)
                for row in _replication_rows(recording, conn_id, ts_ns, direction, obs.topic, rec, stripped):
                    out.add("replication", row)
        except (ProtocolError, ValueError) as exc:
            out.add("problems", {"recording": recording, "conn_id": conn_id, "ts_ns": ts_ns,
                                 "where": f"{direction} frame", "message": f"{type(exc).__name__}: {exc}"})
    for pair in tracker.close(last_ts):
        out.add("requests", _request_row(recording, conn_id, pair))
    return out


def frame_from_record_fields(data: bytes, size: int, stripped: bool) -> Frame:
    """A Frame from recorded bytes (zero-filling a stripped payload, as the reader does)."""
    from proxy.recording.reader import RecordedFrame

    return RecordedFrame(0, "to_broker", "client", 0, data, size, payload_stripped=stripped).frame



def reference_tables(recording_dirs: Iterable[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every row of ``frames``, ``requests``, ``messages``, ``replication`` and ``problems`` for some recordings."""
    by_conn: dict[tuple[str, int], list[tuple[tuple[int, int], tuple[Any, ...]]]] = {}
    for directory in recording_dirs:
        for path in sorted(directory.glob("segment-*.ptap")):
            content = path.read_bytes()
            recording = segment_recording_id(content) or directory.name
            for conn, offset, frame in segment_frames(recording, path.name, content):
                by_conn.setdefault((recording, conn), []).append(((segment_index(path.name), offset), frame))
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
    for (recording, conn), frames in by_conn.items():
        frames.sort(key=lambda item: item[0])
        tables = connection_tables(recording, conn, [f for _, f in frames]).tables
        for name, cols in tables.items():
            names = list(cols)
            rows[name] += [dict(zip(names, values, strict=True)) for values in zip(*cols.values(), strict=True)]
    return rows
