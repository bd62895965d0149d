"""The recording writer's CPU per frame: frames recorded per writer CPU-second, this tree against another.

    .venv/bin/python bench/writer.py [--rounds 5] [--baseline DIR] [--share]

What the recording's writer process does at saturation, without the proxy: what
:meth:`~proxy.recording.writer.SegmentWriter.write` does (``encode_batch``, then
``SegmentFiles.append``) with batches of 8 MiB of runs (1 MiB each, views of shared memory as the
run ring's are) of SEND frames of 100 B and of 1 KiB (whole-frame sizes, as bench/passthrough.py's
observer arms send) into a temporary directory. Its CPU time (``time.process_time``: user and
system) per frame is taken per batch; the figure is the median over the batches, for the cut alone
(``encode_batch``) and with the append to the segment file (which on a machine whose free memory was
never touched costs ~2 us of kernel time per KiB for fresh page-cache pages, ~0.3 us when pages are
reused). ``--baseline DIR`` measures another checkout (e.g. ``git archive main | tar -x -C DIR``) in
the same run: each round runs each tree in a process of its own, one after the other, and the table
gives each tree's medians and their ratios.

``--share`` also runs the writer process itself (``WriterProcess``, niced, its CPU budget) at
saturation: batches of 8 runs in a run ring handed over back to back for 0.4 s and for 4 s (the
phases of bench/passthrough.py's observer arms at ``--duration 2`` and ``20``), each after a quiet
second, and gives its cores over each (its share is 0.25; on a busy machine niceness holds it lower).
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (("100 B", 100), ("1 KiB", 1024))
RUN_BYTES = 1 << 20
BATCH_RUNS = 8


def measure(batches: int) -> dict[str, float]:
    """ns of writer CPU per frame at each size, the median of ``batches`` batches (run in the tree measured)."""
    from proxy.core.run_cutter import RunCutter
    from proxy.pb import recording_pb2 as rpb
    from proxy.recording.writer import RecordConfig, RunItem, SegmentFiles, encode_batch

    figures: dict[str, float] = {}
    streams: dict[tuple[int, int], RunCutter] = {}
    for label, size in SIZES:
        per_run = RUN_BYTES // size
        run = send_run(size)
        ring = mmap.mmap(-1, len(run) * BATCH_RUNS)
        for index in range(BATCH_RUNS):
            ring[index * len(run):(index + 1) * len(run)] = run
        view = memoryview(ring)
        cut, total = [], []
        with tempfile.TemporaryDirectory() as directory:
            config = RecordConfig(dir=Path(directory))
            files = SegmentFiles(Path(directory), "bench", config, time.time_ns)
            stream_pos = 0
            for batch_index in range(batches + 1):
                batch = []
                for index in range(BATCH_RUNS):
                    data = view[index * len(run):(index + 1) * len(run)]
                    batch.append(RunItem(1, rpb.TO_BROKER, time.time_ns(), data, 0, stream_pos))
                    stream_pos += len(run)
                began = time.process_time()
                records, result = encode_batch(batch, config, streams)
                encoded = time.process_time()
                files.append(records)
                if batch_index:  # (the first batch opens the segment)
                    cut.append((encoded - began) / result.frames * 1e9)
                    total.append((time.process_time() - began) / result.frames * 1e9)
                assert result.frames == per_run * BATCH_RUNS
                del batch, records, data
            files.close(None)
        figures[f"cut {label}"] = statistics.median(cut)
        figures[f"write {label}"] = statistics.median(total)
    return figures


#: stretches of saturation the writer's share is measured over, each after a quiet second (``--share``)
PHASES = (0.4, 4.0)


def send_run(size: int) -> bytes:
    """1 MiB (about) of SEND frames of ``size`` bytes each."""
    from proxy.pb import PulsarApi_pb2 as api
    from proxy.protocol.frame import encode_payload_command

    def send(sequence_id: int) -> bytes:
        def command(payload: bytes) -> bytes:
            return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence_id),
                                          api.MessageMetadata(producer_name="p", sequence_id=sequence_id,
                                                              publish_time=1), payload)
        return command(b"x" * (size - len(command(b""))))

    return b"".join(send(1000 + index % 100) for index in range(RUN_BYTES // size))


def measure_share() -> dict[str, float]:
    """The recording's writer process's cores over each of ``PHASES`` of saturation (batches of ``BATCH_RUNS``
    runs handed over back to back, as the recorder does when its ring is full), each after a quiet second."""
    from interleave import process_cpu_seconds  # (bench/: the script's directory)

    from proxy.pb import recording_pb2 as rpb
    from proxy.recording.run_ring import RunRing
    from proxy.recording.writer import RecordConfig, RunItem
    from proxy.recording.writer_process import WriterProcess

    figures: dict[str, float] = {}
    for label, size in SIZES:
        run = send_run(size)
        ring = RunRing.create(len(run) * BATCH_RUNS)
        offsets = [ring.put(run) for _ in range(BATCH_RUNS)]
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "rec"
            path.mkdir()
            writer = WriterProcess(path, RecordConfig(dir=path), ring)
            ring.close_fd()
            writer.started()
            stream_pos = 0
            for phase in PHASES:
                time.sleep(1.0)
                child = writer._process.pid
                cpu_before, began = process_cpu_seconds(child), time.monotonic()
                while time.monotonic() - began < phase:
                    batch = []
                    for offset in offsets:
                        assert offset is not None
                        batch.append(RunItem(1, rpb.TO_BROKER, time.time_ns(), ring.view[offset:offset + len(run)], 0,
                                             stream_pos, offset))
                        stream_pos += len(run)
                    writer.write(batch)
                figures[f"cores {phase:g}s {label}"] = \
                    (process_cpu_seconds(child) - cpu_before) / (time.monotonic() - began)
            writer.close(None)
        ring.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8, help="batches per size and round")
    parser.add_argument("--baseline", type=Path, metavar="DIR")
    parser.add_argument("--share", action="store_true",
                        help="also the writer process's cores over 0.4 s and 4 s of saturation after a quiet second")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # (a tree's own process)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps({**measure(args.batches), **(measure_share() if args.share else {})}))
        return
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in order:
            tree = trees[name]
            # (run in the tree: -m-less, the script's own directory first, then the tree measured)
            command = [sys.executable, str(tree / "bench" / "writer.py"), "--measure", "--batches", str(args.batches),
                       *(["--share"] if args.share else [])]
            output = subprocess.run(command, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""},
                                    stdout=subprocess.PIPE, text=True, check=True).stdout
            for label, value in json.loads(output).items():
                samples[name].setdefault(label, []).append(value)
    print(f"writer CPU per frame (ns, median of {args.rounds} rounds of {args.batches} batches of "
          f"{BATCH_RUNS} x 1 MiB runs; cut: encode_batch, write: the cut and the append to the segment), "
          "and frames per writer CPU-second:")
    for label, _ in SIZES:
        for part in ("cut", "write"):
            key = f"{part} {label}"
            line = f"  {key:<12}" + "".join(f"  {name}: {statistics.median(samples[name][key]):6.0f} ns "
                                            f"({1e9 / statistics.median(samples[name][key]):>10,.0f} f/s)"
                                            for name in trees)
            if "baseline" in trees:
                ratio = statistics.median(samples["baseline"][key]) / statistics.median(samples["this tree"][key])
                line += f"   x baseline {ratio:.2f}"
            print(line)
    if args.share:
        print(f"the writer process's cores over a stretch of saturation after a quiet second (median of {args.rounds} "
              "rounds; its share is 0.25):")
        for label, _ in SIZES:
            cores = {name: " ".join(f"{phase:g} s {statistics.median(samples[name][f'cores {phase:g}s {label}']):.2f}"
                                    for phase in PHASES) for name in trees}
            print(f"  {label:<6}" + "   ".join(f"{name}: {text}" for name, text in cores.items()))

if __name__ == "__main__":
    main()
