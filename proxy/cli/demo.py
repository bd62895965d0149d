"""``pulsar-tap demo``: the main job on embedded defaults.

Until the proxy and the embedded broker exist, the demo decodes a bundled sample
of real frames (``proxy/data/sample_client_frames.bin``: one session of the
official Pulsar client, captured by ``tests/golden/capture.py``) with the frame
codec and prints them as a table: each frame's command, size and key fields, the
messages inside each SEND (decompressed and batch-split), and a summary line.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.protocol.frame import Frame

NAME = "demo"
HELP = "run the main job on embedded defaults"
DESCRIPTION = """\
Decode and print a bundled sample of frames the official Pulsar client sent
(one session: connect, lookup, two producers, a batched LZ4 send, a consumer
that subscribes, flows and acks).

example:
  pulsar-tap demo
"""

SAMPLE_RESOURCE = "sample_client_frames.bin"


def configure(parser: argparse.ArgumentParser) -> None:
    del parser


def load_sample() -> bytes:
    """The bundled sample stream, read from the installed package."""
    from importlib import resources

    return resources.files("proxy").joinpath("data", SAMPLE_RESOURCE).read_bytes()


def describe(frame: Frame) -> str:
    """The key fields of one frame, as ``name=value`` pairs."""
    from proxy.protocol.compression import compression_name

    cmd = frame.command
    kind = frame.type_name
    if kind == "CONNECT":
        return f"client={cmd.connect.client_version} protocol_version={cmd.connect.protocol_version}"
    if kind == "PARTITIONED_METADATA":
        return f"topic={cmd.partitionMetadata.topic} request_id={cmd.partitionMetadata.request_id}"
    if kind == "LOOKUP":
        return f"topic={cmd.lookupTopic.topic} request_id={cmd.lookupTopic.request_id}"
    if kind == "PRODUCER":
        p = cmd.producer
        return f"topic={p.topic} producer_id={p.producer_id} producer_name={p.producer_name} request_id={p.request_id}"
    if kind == "SEND" and frame.payload is not None:
        meta = frame.payload.metadata
        num = cmd.send.num_messages if cmd.send.HasField("num_messages") else 1
        return (f"producer_id={cmd.send.producer_id} sequence_id={cmd.send.sequence_id} num_messages={num} "
                f"compression={compression_name(meta.compression)} payload={len(frame.payload.payload)} B")
    if kind == "CLOSE_PRODUCER":
        return f"producer_id={cmd.close_producer.producer_id} request_id={cmd.close_producer.request_id}"
    if kind == "SUBSCRIBE":
        s = cmd.subscribe
        return (f"topic={s.topic} subscription={s.subscription} consumer_id={s.consumer_id} "
                f"request_id={s.request_id}")
    if kind == "FLOW":
        return f"consumer_id={cmd.flow.consumer_id} permits={cmd.flow.messagePermits}"
    if kind == "ACK":
        ids = ", ".join(f"{m.ledgerId}:{m.entryId}" for m in cmd.ack.message_id)
        return f"consumer_id={cmd.ack.consumer_id} message_ids={ids}"
    if kind == "CLOSE_CONSUMER":
        return f"consumer_id={cmd.close_consumer.consumer_id} request_id={cmd.close_consumer.request_id}"
    return ""


def render(stream: bytes) -> list[str]:
    """The table lines (and the summary line) for a stream of client frames."""
    from proxy.protocol.frame import FrameDecoder
    from proxy.protocol.message import decode_messages

    decoder = FrameDecoder()
    frames = decoder.receive(stream)
    decoder.close()
    lines = [f"{'#':>3}  {'command':<20} {'bytes':>6}  details", f"{'-' * 3}  {'-' * 20} {'-' * 6}  {'-' * 40}"]
    counts: Counter[str] = Counter()
    messages = sends = 0
    for index, frame in enumerate(frames):
        counts[frame.type_name] += 1
        lines.append(f"{index:>3}  {frame.type_name:<20} {frame.size:>6}  {describe(frame)}")
        if frame.payload is not None:
            frame.payload.verify_checksum()
            sends += 1
            for message in decode_messages(frame.payload.metadata, frame.payload.payload):
                messages += 1
                props = ",".join(f"{k}={v}" for k, v in sorted(message.properties.items()))
                lines.append(f"{'':>3}  {'':<20} {'':>6}    message key={message.key} "
                             f"sequence_id={message.sequence_id} payload={message.size} B properties={props}")
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    lines.append(f"{len(frames)} frames, {len(stream)} bytes, {messages} messages in {sends} SENDs, "
                 f"all checksums valid: {kinds}")
    return lines


def run(args: argparse.Namespace) -> int:
    del args
    for line in render(load_sample()):
        print(line)
    return 0
