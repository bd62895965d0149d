"""The data path in bulk: a run of passed-through SENDs or SEND_RECEIPTs accounted frame by frame at ~1 µs each.

Telemetry's per-frame data path (:mod:`proxy.telemetry.data_path`) reads a SEND's or a
receipt's ids into integers and files the SEND with the session machine, which builds
a few objects per request; at saturation that is several microseconds a frame, so the
observer hub drops most runs and /metrics counts a few per cent of the requests.  Here a
run is walked once, in place (no copy per frame):

- a compiled walk (:mod:`proxy.telemetry.bulk_forms`) takes the canonical encoding of a SEND's command
  (``08 06 32 LEN 08 <producer_id> 10 <sequence_id> [18 <num_messages>]``, PulsarApi.proto
  ``CommandSend``) or a receipt's (``CommandSendReceipt``: the same two ids, an optional
  ``MessageIdData`` of varint fields whose length is checked, an optional
  ``highest_sequence_id``) and reads what the path needs;
- SEND and SEND_RECEIPT encode ``producer_id`` and ``sequence_id`` as the same bytes
  ``08 <pid> 10 <seq>`` when the varints are minimal (the walk insists), so a SEND is
  filed in the connection's :class:`SendBook` under those raw bytes and its receipt
  finds it by them, with no integer decoded;
- counters are added up per run (frames, bytes, messages per topic) and the latencies
  of the run's exchanges go into the histogram together (``record_many``, in order, so
  sums are the same floats);
- trace sampling is drawn per exchange, in the same order as one frame at a time, and
  a span is built only for a sampled one.

The book is a faster form of state the session machine would hold, nothing more: the
:class:`~proxy.telemetry.tracker.ConnectionTimeline` files its entries with the session
(:meth:`~proxy.telemetry.tracker.ConnectionTimeline.settle`) before any frame takes
another path, so the session sees its requests in the order they came.  A frame the
walk does not take, a producer that is a geo-replicator, a payload that may carry
trace context, a key a SEND on another path may hold, or a book about to reach the
session's limits: that frame goes down the per-frame path, so every exported figure is
what frames fed one by one produce.
"""

from __future__ import annotations

import struct
from typing import Final

from proxy.recording.segment import varint

#: a frame's TOTAL_SIZE and CMD_SIZE
FRAME_HEAD: Final = struct.Struct(">II")

#: (received_ns, forwarded_ns, frame size, num_messages, topic) of a SEND in the book
BookEntry = tuple[int, int, int, int, "str | None"]


class SendBook:
    """One connection's SENDs read in bulk and not yet answered, by ``08 <pid> 10 <seq>``; see the module docstring."""

    __slots__ = ("entries", "other_keys")

    def __init__(self) -> None:
        self.entries: dict[bytes, BookEntry] = {}
        #: keys of SENDs filed with the session by the other paths (a superset: entries stay until the
        #: session holds no request at all), which a SEND or receipt in bulk must leave to those paths
        self.other_keys: set[bytes] = set()


def varint_value(raw: bytes) -> int:
    """The value of one whole varint."""
    value = shift = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        shift += 7
    return value


def key_ids(key: bytes) -> tuple[int, int]:
    """(producer_id, sequence_id) of a key ``08 <pid> 10 <seq>``."""
    last = 1
    while key[last] >= 0x80:  # the producer id's varint ends at its first byte below 0x80
        last += 1
    return varint_value(key[1:last + 1]), varint_value(key[last + 2:])


def key_of(producer_id: int, sequence_id: int) -> bytes:
    """The key a SEND of these ids has in the book (minimal varints)."""
    return b"\x08" + varint(producer_id) + b"\x10" + varint(sequence_id)


__all__ = ["FRAME_HEAD", "BookEntry", "SendBook", "key_ids", "key_of", "varint_value"]
