"""Recorder throughput: how many frames per second the Trio recorder writes, and how many it drops.

    .venv/bin/python bench/recording.py [--frames N] [--size BYTES] [--queue N]

Feeds SEND frames of ``--size`` payload bytes into a real Recorder on a temporary
directory as fast as one task can (yielding every 100 frames, as a busy proxy
would), then prints frames/s, MB/s and drops.  The proxy's passthrough with
recording on vs off needs the proxy wired to RecordingObserver; until then this
measures the recorder alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import trio

# run from any checkout: import its own package, not the one the virtualenv's editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_payload_command
from proxy.recording.reader import open_recordings
from proxy.recording.writer import RecordConfig
from proxy.server.recorder import Recorder


async def bench(frames: int, size: int, queue: int) -> None:
    raw = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=1),
                                 api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1), b"x" * size)
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        async with Recorder(RecordConfig(dir=Path(directory), queue_size=queue)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", time.time_ns())
            for i in range(frames):
                recorder.record(1, "to_broker", "client", time.time_ns(), raw)
                if i % 100 == 99:
                    await trio.lowlevel.checkpoint()
            fed = time.perf_counter() - start
        total = time.perf_counter() - start
        written = recorder.stats.frames_recorded
        read_start = time.perf_counter()
        read = sum(1 for _ in open_recordings(directory).frames())
        read_s = time.perf_counter() - read_start
    print(f"frames fed {frames} of {len(raw)} B in {fed:.2f} s; recorded {written}, dropped "
          f"{recorder.stats.frames_dropped}; total with drain {total:.2f} s")
    print(f"recorder: {written / total:,.0f} frames/s, {written * len(raw) / total / 1e6:,.1f} MB/s; "
          f"reader: {read / read_s:,.0f} frames/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--queue", type=int, default=10_000)
    args = parser.parse_args()
    trio.run(bench, args.frames, args.size, args.queue)


if __name__ == "__main__":
    main()
