"""The compiled decoder reads as protobuf reads: the wire reader it uses for common SingleMessageMetadata
gives what protobuf gives, or leaves the message to protobuf (that it runs compiled: tests/test_compiled.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.analytics import decode
from proxy.errors import BatchError
from proxy.pb import PulsarApi_pb2 as api


def _protobuf_values(meta: bytes) -> tuple[Any, ...] | str:
    try:
        return decode._single_message_values(meta, 3, 1000)
    except BatchError as exc:
        return str(exc)


_TEXT = st.text(max_size=4)
_NUMBER = st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))


@st.composite
def single_metadata(draw: st.DrawFn) -> bytes:
    """SingleMessageMetadata with any of its fields (some required ones missing), maybe damaged."""
    meta = api.SingleMessageMetadata()
    for name, values in (("payload_size", st.integers(-2**31, 2**31 - 1)), ("partition_key", _TEXT),
                         ("compacted_out", st.booleans()), ("event_time", _NUMBER),
                         ("partition_key_b64_encoded", st.booleans()), ("ordering_key", st.binary(max_size=3)),
                         ("sequence_id", _NUMBER), ("null_value", st.booleans()),
                         ("null_partition_key", st.booleans())):
        if draw(st.integers(0, 2)):
            setattr(meta, name, draw(values))
    for _ in range(draw(st.integers(0, 2) if draw(st.integers(0, 5)) == 0 else st.just(0))):
        meta.properties.add(key=draw(_TEXT), value=draw(_TEXT))
    data = meta.SerializePartialToString()
    if draw(st.booleans()):  # a field again (the last one wins), or a field protobuf does not know
        data += draw(st.sampled_from([b"\x18\x05", b"\x40\x00", b"\x12\x01z", b"\x58\x01", b"\x1a\x00", b"\x45"]))
    damage = draw(st.integers(0, 3))
    if damage == 1 and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    elif damage == 2:
        data = data[:draw(st.integers(0, len(data)))]
    return data


@given(st.one_of(single_metadata(), st.binary(max_size=24)))
@settings(max_examples=2000, deadline=None)
@example(b"\x18\x03")
@example(b"\x18\x03\x12\x02\xff\xfe")  # a key that is not UTF-8
@example(b"\x18\xff\xff\xff\xff\x0f")  # payload_size -1 as an over-long varint
@example(b"\x18\x03\x40\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01")  # sequence id past 63 bits
def test_the_wire_reader_gives_what_protobuf_gives_or_leaves_the_message_to_it(meta: bytes) -> None:
    fields = decode.single_message_fields(b"\x00\x00" + meta + b"\x99", 2, 2 + len(meta))
    if fields[0]:
        assert decode.common_message_values(fields, 3, 1000) == _protobuf_values(meta)


def test_the_wire_reader_reads_what_clients_send() -> None:
    """Not leaving everything to protobuf: batches as the Java and C++ clients write them are read off the wire."""
    for meta in (api.SingleMessageMetadata(payload_size=120),
                 api.SingleMessageMetadata(payload_size=0, partition_key="", sequence_id=0),
                 api.SingleMessageMetadata(payload_size=9, partition_key="k\u00e9", sequence_id=2**63 - 1,
                                           event_time=17, ordering_key=b"o", null_value=True)):
        data = meta.SerializeToString()
        fields = decode.single_message_fields(data, 0, len(data))
        assert fields[0], meta
        assert decode.common_message_values(fields, 3, 1000) == _protobuf_values(data)
