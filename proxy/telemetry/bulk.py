"""The data path in bulk: a run of passed-through SENDs or SEND_RECEIPTs accounted frame by frame at ~1 µs each.

Telemetry's per-frame data path (:mod:`proxy.telemetry.data_path`) reads a SEND's or a
receipt's ids into integers and files the SEND with the session machine, which builds
a few objects per request; at saturation that is several microseconds a frame, so the
observer hub drops most runs and /metrics counts a few per cent of the requests.  Here a
run is walked once, in place (no copy per frame):

- a precompiled pattern matches (``fullmatch`` over the command's bytes) the canonical encoding of a SEND's command
  (``08 06 32 LEN 08 <producer_id> 10 <sequence_id> [18 <num_messages>]``, PulsarApi.proto
  ``CommandSend``) or a receipt's (``CommandSendReceipt``: the same two ids, an optional
  ``MessageIdData`` of varint fields whose length is checked, an optional
  ``highest_sequence_id``);
- SEND and SEND_RECEIPT encode ``producer_id`` and ``sequence_id`` as the same bytes
  ``08 <pid> 10 <seq>`` when the varints are minimal (the pattern insists), so a SEND is
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
patterns do not take, a producer that is a geo-replicator, a payload that may carry
trace context, a key a SEND on another path may hold, or a book about to reach the
session's limits: that frame goes down the per-frame path, so every exported figure is
what frames fed one by one produce.
"""

from __future__ import annotations

import re
import struct
from typing import Final

from proxy.recording.segment import varint

#: a varint telemetry keys on: minimal (so its bytes name one value), at most 9 bytes (< 2**63)
_KEY: Final = rb"(?:[\x00-\x7f]|[\x80-\xff]{1,8}[\x01-\x7f])"
#: any varint protobuf reads as a 64-bit value: at most 10 bytes, the tenth 0 or 1
_VARINT: Final = rb"(?:[\x80-\xff]{0,8}[\x00-\x7f]|[\x80-\xff]{9}[\x00\x01])"
#: a varint of up to 9 bytes (_VARINT's first form)
_SHORT_VARINT: Final = rb"[\x80-\xff]{0,8}[\x00-\x7f]"
#: num_messages as the per-frame path accepts it (< 2**31): minimal here, at most 4 bytes (< 2**28)
_COUNT: Final = rb"(?:[\x00-\x7f]|[\x80-\xff]{1,3}[\x01-\x7f])"

#: a SEND's BaseCommand from offset 8: groups (key, producer id, num_messages or None)
SEND_COMMAND: Final = re.compile(rb"\x08\x06\x32[\x00-\x7f](\x08(" + _KEY + rb")\x10" + _KEY + rb")(?:\x18("
                                 + _COUNT + rb"))?")
#: a SEND_RECEIPT's BaseCommand from offset 8: groups (key, message id length or None, message id or None);
#: MessageIdData as the per-frame path takes it (ledgerId, entryId, then partition, batch_index, batch_size;
#: the last two tried last, so that a ``20`` after the message id is first read as highest_sequence_id)
RECEIPT_COMMAND: Final = re.compile(
    rb"\x08\x07\x3a[\x00-\x7f](\x08" + _KEY + rb"\x10" + _KEY + rb")(?:\x1a([\x00-\x7f])(\x08" + _VARINT
    + rb"\x10" + _VARINT + rb"(?:\x18" + _VARINT + rb")?(?:\x20" + _VARINT + rb")??(?:\x30" + _VARINT
    + rb")??))?(?:\x20" + _VARINT + rb")?")

#: the receipt brokers send (Apache Pulsar's and the embedded one): RECEIPT_COMMAND's groups for the commands
#: it matches, tried first (~0.2-0.4 us a receipt cheaper: RECEIPT_COMMAND's optional fields and lazy
#: quantifiers cost the engine more than the rest of a receipt's work).  It takes a subset of what
#: RECEIPT_COMMAND takes (a message id of ledgerId and entryId in varints of up to 9 bytes, then perhaps
#: highest_sequence_id), and RECEIPT_COMMAND, which reads a ``20`` after the message id as
#: highest_sequence_id first, finds the same groups there
COMMON_RECEIPT_COMMAND: Final = re.compile(
    rb"\x08\x07\x3a[\x00-\x7f](\x08" + _KEY + rb"\x10" + _KEY + rb")\x1a([\x00-\x7f])(\x08" + _SHORT_VARINT
    + rb"\x10" + _SHORT_VARINT + rb")(?:\x20" + _SHORT_VARINT + rb")?")

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


__all__ = ["COMMON_RECEIPT_COMMAND", "FRAME_HEAD", "RECEIPT_COMMAND", "SEND_COMMAND", "BookEntry", "SendBook",
           "key_ids", "key_of", "varint_value"]
