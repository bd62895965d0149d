"""Recordings as pcapng: each connection one TCP conversation, framed as real packets.

pcapng (IETF draft "PCAP Next Generation Dump File Format"): a Section Header
Block, one Interface Description Block (Ethernet, nanosecond timestamps via
``if_tsresol`` = 9), then one Enhanced Packet Block per packet, little-endian.

A :class:`TcpConversation` turns one connection's frames into Ethernet + IPv4
(or IPv6) + TCP packets between the recorded client and broker addresses: a
three-way handshake at the connection's start, the frames' bytes as data
segments at their capture times (split at :data:`MAX_SEGMENT` bytes) with
sequence and acknowledgement numbers that follow the byte counts, and a FIN
exchange at its end.  IP and TCP checksums are computed, so Wireshark reports no
errors.  Hosts that are names rather than addresses get a stable stand-in in
198.18.0.0/15 (the benchmarking range).  Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import struct
from dataclasses import dataclass, field
from typing import Final

LINKTYPE_ETHERNET: Final = 1
#: largest TCP payload per packet (keeps every IPv4 packet under 65535 bytes)
MAX_SEGMENT: Final = 65000

_SHB_TYPE: Final = 0x0A0D0D0A
_IDB_TYPE: Final = 0x00000001
_EPB_TYPE: Final = 0x00000006
_BYTE_ORDER_MAGIC: Final = 0x1A2B3C4D
_OPT_IF_TSRESOL: Final = 9

_FIN, _SYN, _PSH, _ACK = 0x01, 0x02, 0x08, 0x10
_CLIENT_MAC: Final = bytes.fromhex("020000000001")
_BROKER_MAC: Final = bytes.fromhex("020000000002")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _pad4(data: bytes) -> bytes:
    return data + bytes(-len(data) % 4)


def section_header_block() -> bytes:
    body = struct.pack("<IHHq", _BYTE_ORDER_MAGIC, 1, 0, -1)
    total = 12 + len(body)
    return struct.pack("<II", _SHB_TYPE, total) + body + struct.pack("<I", total)


def interface_description_block(linktype: int = LINKTYPE_ETHERNET) -> bytes:
    options = struct.pack("<HH", _OPT_IF_TSRESOL, 1) + _pad4(bytes([9])) + struct.pack("<HH", 0, 0)
    body = struct.pack("<HHI", linktype, 0, 0) + options
    total = 12 + len(body)
    return struct.pack("<II", _IDB_TYPE, total) + body + struct.pack("<I", total)


def enhanced_packet_block(ts_ns: int, packet: bytes, interface_id: int = 0) -> bytes:
    ts = max(ts_ns, 0)
    body = struct.pack("<IIIII", interface_id, ts >> 32, ts & 0xFFFFFFFF, len(packet), len(packet)) + _pad4(packet)
    total = 12 + len(body)
    return struct.pack("<II", _EPB_TYPE, total) + body + struct.pack("<I", total)


def internet_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\x00"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def stand_in_address(host: str) -> ipaddress.IPv4Address:
    """A stable address in 198.18.0.0/15 for a host given by name."""
    digest = int.from_bytes(hashlib.sha256(host.encode()).digest()[:4], "big")
    return ipaddress.IPv4Address((198 << 24) + (18 << 16) + (digest % (1 << 17)))


def resolve_host(host: str) -> IPAddress:
    """The address of ``host`` if it is a literal address, else its stand-in (never a DNS query)."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return stand_in_address(host)


def tcp_packet(src: IPAddress, dst: IPAddress, sport: int, dport: int, seq: int, ack: int, flags: int,
               payload: bytes, src_mac: bytes, dst_mac: bytes, ip_id: int = 0) -> bytes:
    """One Ethernet frame holding an IPv4/IPv6 TCP segment, with correct checksums."""
    header = struct.pack("!HHIIBBHHH", sport, dport, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, 5 << 4, flags,
                         65535, 0, 0)
    tcp_length = len(header) + len(payload)
    if isinstance(src, ipaddress.IPv4Address) and isinstance(dst, ipaddress.IPv4Address):
        pseudo = src.packed + dst.packed + struct.pack("!BBH", 0, 6, tcp_length)
        checksum = internet_checksum(pseudo + header + payload)
        header = header[:16] + struct.pack("!H", checksum) + header[18:]
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + tcp_length, ip_id & 0xFFFF, 0x4000, 64, 6, 0,
                         src.packed, dst.packed)
        ip = ip[:10] + struct.pack("!H", internet_checksum(ip)) + ip[12:]
        ethertype = 0x0800
    else:
        src6, dst6 = _as_v6(src), _as_v6(dst)
        pseudo = src6.packed + dst6.packed + struct.pack("!I3xB", tcp_length, 6)
        checksum = internet_checksum(pseudo + header + payload)
        header = header[:16] + struct.pack("!H", checksum) + header[18:]
        ip = struct.pack("!IHBB16s16s", 6 << 28, tcp_length, 6, 64, src6.packed, dst6.packed)
        ethertype = 0x86DD
    return dst_mac + src_mac + struct.pack("!H", ethertype) + ip + header + payload


def _as_v6(addr: IPAddress) -> ipaddress.IPv6Address:
    if isinstance(addr, ipaddress.IPv6Address):
        return addr
    return ipaddress.IPv6Address(f"::ffff:{addr}")


@dataclass(slots=True)
class _Side:
    address: IPAddress
    port: int
    mac: bytes
    next_seq: int
    packets: int = 0


@dataclass(slots=True)
class TcpConversation:
    """The packets of one connection, generated as its frames come (see the module docstring)."""

    conn_id: int
    client: _Side
    broker: _Side
    opened: bool = False
    closed: bool = False
    #: TCP payload bytes sent by the client and by the broker
    payload_bytes: dict[str, int] = field(default_factory=lambda: {"to_broker": 0, "to_client": 0})

    @classmethod
    def between(cls, conn_id: int, client_host: str, client_port: int, broker_host: str,
                broker_port: int) -> TcpConversation:
        client_ip, broker_ip = resolve_host(client_host), resolve_host(broker_host)
        seed = hashlib.sha256(f"pulsar-tap:{conn_id}".encode()).digest()
        return cls(conn_id,
                   _Side(client_ip, client_port, _CLIENT_MAC, int.from_bytes(seed[:4], "big")),
                   _Side(broker_ip, broker_port, _BROKER_MAC, int.from_bytes(seed[4:8], "big")))

    def _packet(self, sender: _Side, receiver: _Side, flags: int, payload: bytes = b"") -> bytes:
        packet = tcp_packet(sender.address, receiver.address, sender.port, receiver.port, sender.next_seq,
                            receiver.next_seq if flags & _ACK else 0, flags, payload, sender.mac, receiver.mac,
                            ip_id=sender.packets)
        sender.packets += 1
        sender.next_seq = (sender.next_seq + len(payload) + (1 if flags & (_SYN | _FIN) else 0)) & 0xFFFFFFFF
        return packet

    def handshake(self, ts_ns: int) -> list[tuple[int, bytes]]:
        """SYN, SYN-ACK, ACK, one microsecond apart."""
        self.opened = True
        return [
            (ts_ns, self._packet(self.client, self.broker, _SYN)),
            (ts_ns + 1000, self._packet(self.broker, self.client, _SYN | _ACK)),
            (ts_ns + 2000, self._packet(self.client, self.broker, _ACK)),
        ]

    def data(self, ts_ns: int, direction: str, payload: bytes) -> list[tuple[int, bytes]]:
        """The segments carrying one frame's bytes."""
        sender, receiver = (self.client, self.broker) if direction == "to_broker" else (self.broker, self.client)
        self.payload_bytes[direction] += len(payload)
        return [(ts_ns, self._packet(sender, receiver, _PSH | _ACK, payload[i:i + MAX_SEGMENT]))
                for i in range(0, len(payload), MAX_SEGMENT)]

    def teardown(self, ts_ns: int) -> list[tuple[int, bytes]]:
        """FIN from the client, FIN-ACK from the broker, the client's last ACK."""
        self.closed = True
        return [
            (ts_ns, self._packet(self.client, self.broker, _FIN | _ACK)),
            (ts_ns + 1000, self._packet(self.broker, self.client, _FIN | _ACK)),
            (ts_ns + 2000, self._packet(self.client, self.broker, _ACK)),
        ]


__all__ = ["LINKTYPE_ETHERNET", "MAX_SEGMENT", "TcpConversation", "enhanced_packet_block",
           "interface_description_block", "internet_checksum", "resolve_host", "section_header_block",
           "stand_in_address", "tcp_packet"]
