"""Property tests: random commands round-trip; arbitrary bytes never escape the codec's errors."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command, reencode
from proxy.protocol.message import decode_messages, encode_payload

ids = st.integers(min_value=0, max_value=2**63 - 1)
names = st.text(min_size=0, max_size=40)

commands = st.one_of(
    st.builds(lambda t, r, p, n: api.CommandProducer(topic=t, request_id=r, producer_id=p, producer_name=n),
              names, ids, ids, names),
    st.builds(lambda t, s, c, r: api.CommandSubscribe(topic=t, subscription=s, subType=api.CommandSubscribe.Shared,
                                                      consumer_id=c, request_id=r), names, names, ids, ids),
    st.builds(lambda c, n: api.CommandFlow(consumer_id=c, messagePermits=n), ids, st.integers(0, 2**32 - 1)),
    st.builds(lambda t, r, a: api.CommandLookupTopic(topic=t, request_id=r, authoritative=a), names, ids,
              st.booleans()),
    st.builds(lambda r, e, m: api.CommandError(request_id=r, error=e, message=m), ids,
              st.sampled_from(list(api.ServerError.values())), names),
    st.just(api.CommandPing()),
    st.just(api.CommandPong()),
)

messages = st.lists(
    st.tuples(st.binary(max_size=300), st.one_of(st.none(), names),
              st.dictionaries(names, names, max_size=3)),
    min_size=1, max_size=8,
)


def _frames(data: bytes, cuts: list[int]) -> list[bytes] | type[ProtocolError]:
    decoder = FrameDecoder(max_frame_bytes=1 << 16)
    out: list[Frame] = []
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    try:
        for a, b in itertools.pairwise(bounds):
            out += decoder.receive(data[a:b])
            for frame in out:  # decoding what was accepted may fail, but only with our errors
                _ = frame.command
                if frame.payload is not None:
                    _ = frame.payload.metadata
    except ProtocolError as exc:
        return type(exc)
    return [f.raw for f in out]


@given(st.lists(commands, min_size=1, max_size=6))
def test_random_commands_round_trip_byte_for_byte(subs: list[object]) -> None:
    stream = b"".join(encode_command(sub) for sub in subs)
    frames = FrameDecoder().receive(stream)
    assert len(frames) == len(subs)
    for frame in frames:
        assert reencode(frame) == frame.raw


@given(messages, st.sampled_from([0, 1, 2, 3, 4]), st.booleans())
def test_random_messages_round_trip_through_send_frames(msgs: list[tuple[bytes, str | None, dict[str, str]]],
                                                         kind: int, batched: bool) -> None:
    if not batched:
        msgs = msgs[:1]
    singles = []
    for payload, key, props in msgs:
        single = api.SingleMessageMetadata(payload_size=0, properties=[api.KeyValue(key=k, value=v)
                                                                       for k, v in props.items()])
        if key is not None:
            single.partition_key = key
        singles.append((payload, single))
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
    if not batched:
        single = singles[0][1]
        metadata.properties.extend(single.properties)
        if single.HasField("partition_key"):
            metadata.partition_key = single.partition_key
    body = encode_payload(singles, metadata, kind, batched=batched)
    raw = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=1), metadata, body)
    (frame,) = FrameDecoder().receive(raw)
    assert frame.payload is not None
    frame.payload.verify_checksum()
    decoded = decode_messages(frame.payload.metadata, frame.payload.payload)
    assert [(m.payload, m.key, m.properties) for m in decoded] == [(p, k, d) for p, k, d in msgs]
    assert reencode(frame) == raw


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.lists(st.integers(min_value=0), max_size=6))
def test_any_bytes_give_frames_or_a_protocol_error_and_split_points_do_not_matter(
        data: bytes, cuts: list[int]) -> None:
    assert _frames(data, cuts) == _frames(data, [])


@given(st.lists(commands, min_size=1, max_size=4), st.lists(st.integers(min_value=0), max_size=8),
       st.binary(max_size=12))
def test_valid_streams_with_garbage_tails_split_anywhere_decode_the_same(
        subs: list[object], cuts: list[int], tail: bytes) -> None:
    stream = b"".join(encode_command(sub) for sub in subs) + tail
    assert _frames(stream, cuts) == _frames(stream, [])
