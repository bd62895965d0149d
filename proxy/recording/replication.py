"""Geo-replication in a recording: what each replicator sent, when it was stored, and the markers.

A recording made by a proxy on a replication link holds the replicators' traffic:
SENDs of producers named ``pulsar.repl.<local>--><remote>`` (each message keeps the
``publish_time`` its original producer gave it and carries ``replicated_from``) and
the remote broker's SEND_RECEIPTs.  :func:`replicated_sends` pairs them per
connection by ``(producer_id, sequence_id)``; a SEND's **lag** is the capture time of
its receipt (the remote cluster has stored it) minus its publish time (the source
cluster accepted it) — everything the message spent in the source cluster's backlog,
on the link and in the remote broker.  A SEND without a receipt (dropped, or the
link cut before the answer) has no lag; a SEND written again after a reconnection is
a separate row.  :func:`lag_table` buckets the data messages by publish second.

Markers are rows too (``marker`` set, with their one-line label), which is what a
snapshot round trip is reconstructed from.  Everything here is sans-IO over
:class:`~proxy.recording.reader.RecordedFrame` objects in capture order.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import markers
from proxy.protocol.commands import T
from proxy.protocol.session import Direction, SessionTracker
from proxy.recording.reader import RecordedFrame


@dataclass(slots=True)
class ReplicatedSend:
    """One SEND of a replicator and, once it came, its receipt."""

    conn: int
    topic: str | None
    producer_name: str
    producer_id: int
    sequence_id: int
    #: the cluster the message comes from (``replicated_from``)
    source_cluster: str
    publish_time_ms: int
    sent_ns: int
    num_messages: int
    #: the original producer's name and sequence id: the same message sent again has the same
    message_key: tuple[str, int] = ("", 0)
    #: MarkerType name for a replicated-subscription marker, None for data
    marker: str | None = None
    label: str | None = None
    receipt_ns: int | None = None
    #: "ledger:entry" the remote cluster stored it at
    stored_at: str | None = None

    @property
    def lag_ms(self) -> float | None:
        if self.receipt_ns is None:
            return None
        return max(0.0, self.receipt_ns / 1e6 - self.publish_time_ms)


def replicated_sends(frames: Iterable[RecordedFrame]) -> list[ReplicatedSend]:
    """Every replicator SEND in a recording, paired with its receipt when one was recorded."""
    trackers: dict[int, SessionTracker] = {}
    # a replicator's SENDs carry the original sequence ids (every marker's is 0): a key can repeat,
    # and its receipts come back in the order the SENDs went
    pending: dict[tuple[int, int, int], deque[ReplicatedSend]] = defaultdict(deque)
    sends: list[ReplicatedSend] = []
    for recorded in frames:
        if recorded.origin == "proxy":
            continue  # a frame the proxy changed or made is recorded again; count what crossed once
        try:
            frame = recorded.frame
            tracker = trackers.setdefault(recorded.conn, SessionTracker(strict=False))
            observation = tracker.observe(frame, Direction(recorded.direction), recorded.ts_ns)
        except ProtocolError:
            continue
        if frame.type == T.SEND:
            producer = observation.producer
            if producer is None or not markers.is_replicator(producer.producer_name):
                continue
            send = _send_row(recorded, frame.command.send, producer.producer_name or "", observation.topic)
            if send is not None:
                sends.append(send)
                pending[(recorded.conn, send.producer_id, send.sequence_id)].append(send)
        elif frame.type == T.SEND_RECEIPT:
            receipt = frame.command.send_receipt
            waiting = pending.get((recorded.conn, receipt.producer_id, receipt.sequence_id))
            found = waiting.popleft() if waiting else None
            if found is not None:
                found.receipt_ns = recorded.ts_ns
                if receipt.HasField("message_id"):
                    found.stored_at = f"{receipt.message_id.ledgerId}:{receipt.message_id.entryId}"
    return sends


def _send_row(recorded: RecordedFrame, send: api.CommandSend, producer_name: str,
              topic: str | None) -> ReplicatedSend | None:
    try:
        section = recorded.frame.payload
        metadata = section.metadata if section is not None else None
    except ProtocolError:
        return None
    if section is None or metadata is None:
        return None
    row = ReplicatedSend(recorded.conn, topic, producer_name, send.producer_id, send.sequence_id,
                         metadata.replicated_from, metadata.publish_time, recorded.ts_ns,
                         send.num_messages if send.HasField("num_messages") else 1,
                         (metadata.producer_name, metadata.sequence_id))
    if markers.is_marker(metadata):
        row.marker = markers.marker_name(metadata.marker_type)
        if not recorded.payload_stripped:
            try:
                row.label = markers.marker_label(markers.decode_marker(metadata, section.payload))
            except ProtocolError:
                row.label = None
    return row


@dataclass(frozen=True, slots=True)
class LagRow:
    """Replication lag of the data messages published in one bucket of time."""

    start_ms: int
    messages: int
    confirmed: int
    p50_ms: float | None
    max_ms: float | None


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lag_table(sends: Iterable[ReplicatedSend], bucket_ms: int = 1000) -> list[LagRow]:
    """Lag per bucket of publish time (data messages only; a message sent again counts once, by its first receipt)."""
    firsts: dict[tuple[str, str, int], ReplicatedSend] = {}
    for send in sends:
        if send.marker is not None:
            continue
        key = (send.source_cluster, *send.message_key)
        first = firsts.get(key)
        if first is None or (first.receipt_ns is None and send.receipt_ns is not None):
            firsts[key] = send
    buckets: dict[int, list[ReplicatedSend]] = {}
    for send in firsts.values():
        buckets.setdefault(send.publish_time_ms // bucket_ms * bucket_ms, []).append(send)
    rows = []
    for start in sorted(buckets):
        bucket = buckets[start]
        lags = [lag for s in bucket if (lag := s.lag_ms) is not None]
        rows.append(LagRow(start, sum(s.num_messages for s in bucket), sum(s.num_messages for s in bucket
                                                                            if s.receipt_ns is not None),
                           _percentile(lags, 0.5) if lags else None, max(lags) if lags else None))
    return rows


__all__ = ["LagRow", "ReplicatedSend", "lag_table", "replicated_sends"]
