"""``export --pcap``: write a recording as a pcapng capture, one TCP conversation per connection.

Frames are taken in capture-time order across connections; every recorded frame
(including those the proxy changed or sent, origin ``proxy``) becomes TCP payload
in its direction, with its wire size (payloads zero-filled when they were not
recorded).  A connection's handshake is placed at its recorded start, its FIN
exchange at its recorded end (none if the recording stopped while it was open).
Each conversation runs between the recorded client and the broker the proxy routed
the connection to; connections with no recorded addresses (a client that left before
CONNECT) get stand-ins: client 192.0.2.x, broker 198.51.100.1:6650 (documentation
ranges).  ``recordings/pulsar.lua`` is a Wireshark dissector for what is inside.  The
output path is checked before anything is read, and the capture is written under a
temporary name and renamed into place only when complete (:mod:`proxy.recording.output`);
what the reader skipped in a damaged recording is in :attr:`ExportSummary.report`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from proxy.pb import recording_pb2 as rpb
from proxy.recording.output import atomic_output, check_output_file
from proxy.recording.pcap import (
    TcpConversation,
    enhanced_packet_block,
    interface_description_block,
    section_header_block,
)
from proxy.recording.reader import ReadReport, RecordingSet, open_recordings


@dataclass(frozen=True, slots=True)
class ExportSummary:
    connections: int
    packets: int
    frames: int
    #: conn id -> (client-to-broker payload bytes, broker-to-client payload bytes)
    payload_bytes: dict[int, tuple[int, int]]
    #: what the reader skipped (damaged records, a crash's tail, an unusable index)
    report: ReadReport = field(default_factory=ReadReport)


def _conversation(conn_id: int, info: rpb.ConnectionInfo | None) -> TcpConversation:
    client_host, client_port = f"192.0.2.{conn_id % 254 + 1}", 40000 + conn_id % 20000
    broker_host, broker_port = "198.51.100.1", 6650
    if info is not None and info.HasField("client"):
        client_host, client_port = info.client.host, info.client.port
    if info is not None and info.HasField("broker"):
        broker_host, broker_port = info.broker.host, info.broker.port
    return TcpConversation.between(conn_id, client_host, client_port, broker_host, broker_port)


class PcapExport:
    """Generates the capture's packets; :attr:`conversations` fills in as it goes."""

    def __init__(self, recordings: RecordingSet) -> None:
        self.recordings = recordings
        self.conversations: dict[int, TcpConversation] = {}
        self.frames = 0

    def packets(self) -> Iterator[tuple[int, bytes]]:
        """(ts_ns, Ethernet frame) for every packet of the capture, in (nearly) time order."""
        connections = self.recordings.connections
        conversations = self.conversations
        # FIN exchanges wait here until the frames pass their time.
        pending_teardowns: list[tuple[int, int]] = []
        for frame in self.recordings.frames():
            while pending_teardowns and pending_teardowns[0][0] <= frame.ts_ns:
                ts, conn_id = heapq.heappop(pending_teardowns)
                yield from conversations[conn_id].teardown(ts)
            conv = conversations.get(frame.conn)
            if conv is None:
                info = connections.get(frame.conn)
                conv = conversations[frame.conn] = _conversation(frame.conn, info)
                start = info.start_ns if info is not None and info.HasField("start_ns") else 0
                yield from conv.handshake(start if 0 < start <= frame.ts_ns else frame.ts_ns - 3000)
                if info is not None and info.HasField("end_ns"):
                    heapq.heappush(pending_teardowns, (max(info.end_ns, frame.ts_ns), frame.conn))
            self.frames += 1
            yield from conv.data(frame.ts_ns, frame.direction, frame.raw)
        while pending_teardowns:
            ts, conn_id = heapq.heappop(pending_teardowns)
            yield from conversations[conn_id].teardown(ts)
        # A connection that recorded no frame still shows as a handshake (and teardown).
        for conn_id, info in sorted(connections.items()):
            if conn_id in conversations or not info.HasField("start_ns"):
                continue
            conv = conversations[conn_id] = _conversation(conn_id, info)
            yield from conv.handshake(info.start_ns)
            if info.HasField("end_ns"):
                yield from conv.teardown(max(info.end_ns, info.start_ns + 3000))


def write_pcapng(recordings: RecordingSet, out: BinaryIO,
                 should_stop: Callable[[], bool] | None = None) -> ExportSummary:
    """Write the whole capture to ``out``; KeyboardInterrupt once ``should_stop()`` says so (checked often)."""
    export = PcapExport(recordings)
    out.write(section_header_block())
    out.write(interface_description_block())
    packets = 0
    for ts_ns, packet in export.packets():
        out.write(enhanced_packet_block(ts_ns, packet))
        packets += 1
        if should_stop is not None and packets % 256 == 0 and should_stop():
            raise KeyboardInterrupt
    payload = {conn_id: (conv.payload_bytes["to_broker"], conv.payload_bytes["to_client"])
               for conn_id, conv in export.conversations.items()}
    return ExportSummary(len(export.conversations), packets, export.frames, payload, recordings.report)


def export_pcap(path: str, out_path: str | Path, flag: str = "--pcap",
                should_stop: Callable[[], bool] | None = None) -> ExportSummary:
    """Write the recording(s) at ``path`` to ``out_path``: whole, or not at all (``should_stop``: see write_pcapng)."""
    target = check_output_file(out_path, flag)
    recordings = open_recordings(path)
    with atomic_output(target) as out:
        return write_pcapng(recordings, out, should_stop)


__all__ = ["ExportSummary", "PcapExport", "export_pcap", "write_pcapng"]
