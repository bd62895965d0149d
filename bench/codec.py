"""Benchmark of the frame codec: frames/s for SEND frames of 100 B and 64 KiB payloads.

Modes, each over the same buffer of back-to-back SEND frames fed in 64 KiB reads
(the size a proxy's ``receive_some`` asks for):

- ``baseline``: a plain ``struct.unpack_from`` loop that only walks the size prefixes
  of the contiguous buffer; the floor any Python decoder pays.
- ``copy``: the same walk, plus a ``bytes`` slice of every frame; the floor for a
  decoder that hands out frames owning their bytes (ours does, to forward them as is).
- ``header``: ``FrameDecoder`` yields frames and the command type is read
  (``frame.type``); no protobuf decode.  This is what forwarding an untouched frame costs.
- ``full``: as ``header``, plus the BaseCommand (``frame.command``) and the
  MessageMetadata (``frame.payload.metadata``) are decoded.
- ``verify``: as ``full``, plus the CRC32C is checked.
- ``roundtrip``: as ``full``, plus ``reencode(frame)`` (new command bytes, new CRC32C).

Usage: ``.venv/bin/python bench/codec.py [--seconds 1.0]`` (about 2 x 6 x seconds
in total).  Ratios are against the baseline of the same run.
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

# run from any checkout: import its own package, not the one the virtualenv's editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_payload_command, reencode

READ_SIZE = 65536
_U32 = struct.Struct(">I")


def send_frame(payload_size: int, sequence_id: int) -> bytes:
    """A SEND as a producer writes it: realistic metadata, a payload of ``payload_size`` bytes."""
    cmd = api.CommandSend(producer_id=1, sequence_id=sequence_id, num_messages=1)
    meta = api.MessageMetadata(producer_name="bench-producer-0", sequence_id=sequence_id,
                               publish_time=1_700_000_000_000 + sequence_id, partition_key=f"key-{sequence_id}",
                               uncompressed_size=payload_size)
    meta.properties.add(key="app", value="bench")
    payload = bytes((sequence_id + i) & 0xFF for i in range(256)) * (payload_size // 256 + 1)
    return encode_payload_command(cmd, meta, payload[:payload_size])


def build_buffer(payload_size: int, target_bytes: int) -> tuple[bytes, int]:
    frames: list[bytes] = []
    total = 0
    while total < target_bytes or len(frames) < 100:
        frame = send_frame(payload_size, len(frames))
        frames.append(frame)
        total += len(frame)
    return b"".join(frames), len(frames)


def baseline(buf: bytes) -> int:
    pos, end, count = 0, len(buf), 0
    unpack = _U32.unpack_from
    while pos < end:
        total_size = unpack(buf, pos)[0]
        unpack(buf, pos + 4)  # the command size, read as the decoder does
        pos += total_size + 4
        count += 1
    return count


def baseline_copy(buf: bytes) -> int:
    pos, end, count = 0, len(buf), 0
    unpack = _U32.unpack_from
    while pos < end:
        total_size = unpack(buf, pos)[0]
        unpack(buf, pos + 4)
        buf[pos:pos + total_size + 4]  # the copy is what is measured
        pos += total_size + 4
        count += 1
    return count


def _decode(buf: bytes, per_frame: Callable[[object], object]) -> int:
    decoder = FrameDecoder()
    count = 0
    for start in range(0, len(buf), READ_SIZE):
        for frame in decoder.receive(buf[start:start + READ_SIZE]):
            per_frame(frame)
            count += 1
    return count


def header_only(buf: bytes) -> int:
    return _decode(buf, lambda f: f.type)  # type: ignore[attr-defined]


def _full(f: object) -> object:
    f.command  # type: ignore[attr-defined]  # noqa: B018  (decoding is the point)
    return f.payload.metadata  # type: ignore[attr-defined]


def full_decode(buf: bytes) -> int:
    return _decode(buf, _full)


def _verify(f: object) -> object:
    _full(f)
    f.payload.verify_checksum()  # type: ignore[attr-defined]
    return f


def verify(buf: bytes) -> int:
    return _decode(buf, _verify)


def _roundtrip(f: object) -> object:
    _full(f)
    return reencode(f)  # type: ignore[arg-type]


def roundtrip(buf: bytes) -> int:
    return _decode(buf, _roundtrip)


MODES: list[tuple[str, Callable[[bytes], int]]] = [
    ("baseline", baseline), ("copy", baseline_copy), ("header", header_only), ("full", full_decode), ("verify", verify),
    ("roundtrip", roundtrip),
]


def measure(fn: Callable[[bytes], int], buf: bytes, expected: int, seconds: float) -> float:
    """Frames per second: repeat over the buffer until ``seconds`` have passed; best of the runs."""
    if fn(buf) != expected:
        raise RuntimeError(f"{fn.__name__} decoded the wrong number of frames")
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        fn(buf)
        best = max(best, expected / (time.perf_counter() - start))
        if time.perf_counter() >= deadline:
            return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement (default 1.0)")
    args = parser.parse_args(argv)
    print(f"pulsar-tap frame codec, Python {sys.version.split()[0]}, {READ_SIZE // 1024} KiB reads")
    print(f"{'payload':>8} {'frame B':>8} {'mode':<10} {'frames/s':>12} {'MB/s':>9} {'vs baseline':>12} "
          f"{'vs copy':>8}")
    for label, payload_size, target in (("100 B", 100, 1 << 20), ("64 KiB", 64 * 1024, 8 << 20)):
        buf, count = build_buffer(payload_size, target)
        frame_bytes = len(buf) // count
        rates: dict[str, float] = {}
        for name, fn in MODES:
            rate = rates[name] = measure(fn, buf, count, args.seconds)
            print(f"{label:>8} {frame_bytes:>8} {name:<10} {rate:>12,.0f} {rate * frame_bytes / 1e6:>9,.1f} "
                  f"{rate / rates['baseline']:>11.3f}x {rate / rates.get('copy', rate):>7.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
