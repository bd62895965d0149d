"""``pulsar-tap analyze`` on real local Spark: tables, pairing, report, damage, bad input, interrupts."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from proxy.analytics.steps import analyze_in_process
from proxy.analytics.synthetic import Features, SyntheticStats, write_synthetic_recording
from proxy.cli import EXIT_ERROR

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "proxy"]
SPARK_TIMEOUT = 900
TABLES = ("frames", "requests", "messages", "errors", "throughput", "replication")


def analyze(*args: str, env: dict[str, str] | None = None, timeout: float = SPARK_TIMEOUT
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "analyze", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def table(out: Path, name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(out / name).to_pylist()
    return rows


def as_rows(out: Path, name: str) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(sorted(row.items())) for row in table(out, name))


def damage(path: Path, offset: int, length: int = 32) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + length] = bytes((b ^ 0x5A) for b in data[offset:offset + length])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SyntheticStats, Path, Path]:
    """A 24 MiB recording (chunks, replication) and one with a damaged record mid-segment, analysed on local[2]."""
    base = tmp_path_factory.mktemp("recordings")
    stats = write_synthetic_recording(base, 24 * 2**20, connections=24, segment_bytes=6 * 2**20,
                                      features=Features(chunked=True, replication=True))
    damaged = write_synthetic_recording(base, 2 * 2**20, connections=4, seed=2, name="20251122T093320Z-2",
                                        start_ns=1_763_900_000_000_000_000, segment_bytes=2**20)
    damage(damaged.path / "segment-000002.ptap", 50_000)
    for offset in (100_000, 400_000, 700_000):  # (four damaged records in all: more than stderr names)
        damage(damaged.path / "segment-000001.ptap", offset)
    out = tmp_path_factory.mktemp("analysis")
    done = analyze(str(base), "--out", str(out), "--master", "local[2]", "--split-mb", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    out.with_suffix(".stderr").write_text(done.stderr)
    return out, stats, damaged.path, base


def test_every_table_and_both_reports_are_written(analyzed: tuple[Path, SyntheticStats, Path, Path]) -> None:
    out = analyzed[0]
    for name in TABLES:
        assert (out / name / "_SUCCESS").exists(), name
    assert not list(out.glob(".analyze-*")), "the work directory is removed"
    report = (out / "report.txt").read_text()
    assert "Request latency" in report and "Slowest 20 requests" in report and "Replication lag" in report
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "http" not in page.split("<body>")[1]


def test_spark_writes_the_same_tables_as_one_process(analyzed: tuple[Path, SyntheticStats, Path, Path],
                                                     tmp_path: Path) -> None:
    """Row for row (tests/analytics/test_equality.py holds the one-process steps to the reference)."""
    out, _stats, _damaged, base = analyzed
    analyze_in_process([str(base)], str(tmp_path / "one"), split_bytes=2 * 2**20)
    for name in TABLES:
        assert as_rows(out, name) == as_rows(tmp_path / "one", name), name


def test_tables_hold_what_the_recording_holds(analyzed: tuple[Path, SyntheticStats, Path, Path]) -> None:
    out, stats, _damaged, _ = analyzed
    synthetic = stats.path.name
    frames = [r for r in table(out, "frames") if r["recording"] == synthetic]
    assert len(frames) == stats.frames
    requests = [r for r in table(out, "requests") if r["recording"] == synthetic]
    sends = [r for r in requests if r["request_command"] == "SEND"]
    assert len(sends) == sum(1 for f in frames if f["command"] == "SEND") == stats.sends
    assert Counter(r["outcome"] for r in sends) == {"ok": stats.sends - stats.errors, "error": stats.errors}
    assert all(r["latency_us"] is not None and r["latency_us"] > 0 for r in sends)
    assert {r["topic"] for r in sends} <= {f"persistent://public/default/synthetic-{i}" for i in range(7)}
    messages = [r for r in table(out, "messages") if r["recording"] == synthetic]
    assert len(messages) == stats.messages  # batches split, chunks joined: one row per produced message
    assert sum(1 for m in messages if m["key"] == "chunky") == stats.chunked
    errors = [r for r in table(out, "errors") if r["recording"] == synthetic]
    assert Counter(r["error_code"] for r in errors) == {"PersistenceError": stats.errors}
    throughput = [r for r in table(out, "throughput") if r["topic"].endswith(tuple("0123456"))]
    assert sum(r["messages_in"] for r in throughput) >= stats.messages
    replication = [r for r in table(out, "replication") if r["recording"] == synthetic]
    # a marker forwarded by a replicator carries replicated_from too: it is both a replicated message and a marker
    assert Counter(r["kind"] for r in replication) == {"replicated_message": stats.replicated + stats.markers,
                                                        "REPLICATED_SUBSCRIPTION_SNAPSHOT": stats.markers}


def test_requests_latency_matches_show(analyzed: tuple[Path, SyntheticStats, Path, Path]) -> None:
    out, stats, _, _ = analyzed
    shown = subprocess.run([*CLI, "show", str(stats.path), "--json", "--command", "SEND_RECEIPT"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-2000:]
    by_end = {(r["conn_id"], r["end_ns"]): r for r in table(out, "requests") if r["recording"] == stats.path.name}
    lines = shown.stdout.splitlines()
    for line in lines[:200] + lines[-200:]:
        frame = json.loads(line)
        if "latency_us" in frame:
            row = by_end[(frame["conn"], frame["ts_ns"])]
            assert abs(row["latency_us"] - frame["latency_us"]) < 1.0


def test_a_damaged_record_is_skipped_reported_and_the_rest_of_its_segment_read(
        analyzed: tuple[Path, SyntheticStats, Path, Path]) -> None:
    out, _stats, damaged, _ = analyzed
    report = (out / "report.txt").read_text()
    assert "Skipped input" in report
    line = next(line for line in report.splitlines() if "segment-000002.ptap offsets" in line)
    assert "checksum mismatch" in line
    assert sum("ptap offsets" in line for line in report.splitlines()) == 4  # (the report names every one)
    warnings = [line for line in out.with_suffix(".stderr").read_text().splitlines() if "warning" in line]
    assert len(warnings) == 4 and all("ptap offsets" in line for line in warnings[:3]), warnings  # (stderr, three)
    assert warnings[3] == f"pulsar-tap analyze: warning: and 1 more problem with the input: all in {out}/report.txt"
    frames = [r for r in table(out, "frames") if r["recording"] == damaged.name]
    last_of_segment_two = max(f["ts_ns"] for f in frames if f["ts_ns"])
    assert frames and last_of_segment_two
    # records after the damage in the same segment were read: the segment lost one or two records, not all
    truth = analyze_in_process([str(damaged)], None).frames_read
    assert len(frames) == truth


def test_strict_mode_fails_on_a_damaged_segment(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 256 * 1024, connections=2, segment_bytes=64 * 1024)
    (stats.path / "segment-000001.ptap").write_bytes(b"PTAPSEG1\x00\x00\x00\x05garbage-after-header")
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"), "--master", "local[1]", "--strict")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "segment-000001.ptap" in last and "Traceback" not in done.stderr


def test_bad_input_and_output_are_one_clear_line_before_any_work(tmp_path: Path) -> None:
    done = analyze(str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip() == f"pulsar-tap analyze: error: {tmp_path / 'missing'}: no such file or directory"
    done = analyze(str(tmp_path), "--out", str(tmp_path / "o"), "--since", "yesterday-ish")
    assert done.returncode != 0 and "bad time" in done.stderr and "Traceback" not in done.stderr
    started = time.monotonic()
    done = analyze(str(ROOT / "recordings" / "sample"), "--out", "/etc/passwd")
    assert done.returncode == 2 and time.monotonic() - started < 60
    assert done.stderr.strip() == "pulsar-tap analyze: error: --out /etc/passwd: is a file, not a directory"
    done = analyze(str(ROOT / "recordings" / "sample"), "--out", "/etc/passwd/sub")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a directory" in done.stderr


def test_no_java_runtime_is_one_clear_error(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 64 * 1024, connections=1)
    bare_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                if not (Path(p) / "java").exists())
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"),
                   env={"JAVA_HOME": str(tmp_path / "no-jdk"), "PATH": bare_path}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pulsar-tap analyze: error: no Java runtime found: Spark needs one (install a JDK 17+, e.g. with "
        "'bash scripts/setup.sh', or set JAVA_HOME)"]


def test_a_bogus_master_is_one_line_without_a_java_stack(tmp_path: Path) -> None:
    done = analyze(str(ROOT / "recordings" / "sample"), "--out", str(tmp_path / "out"), "--master", "bogus://x")
    assert done.returncode == EXIT_ERROR
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("pulsar-tap analyze: error: Spark did not start on master 'bogus://x'")
    assert "\tat " not in done.stderr and "Traceback" not in done.stderr


def test_quiet_prints_the_report_and_nothing_on_stderr(tmp_path: Path) -> None:
    """The official client through the proxy (recordings/sample), on local[1]."""
    sample = ROOT / "recordings" / "sample"
    done = analyze(str(sample), "--out", str(tmp_path / "out"), "--master", "local[1]", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr
    assert "Request latency" in done.stdout and "WARN" not in done.stdout
    produced = sum(1 for r in table(tmp_path / "out", "messages"))
    assert produced == 200


def _start(tmp_path: Path, recording: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "analyze", str(recording), "--out", str(tmp_path / "out"), "--master", "local[2]",
                             "--split-mb", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _wait_for(process: subprocess.Popen[str], text: str, timeout: float = 300) -> str:
    assert process.stderr is not None
    seen = ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        line = process.stderr.readline()
        assert line and time.monotonic() < deadline, f"{text!r} never came: {seen[-2000:]}"
        seen += line
    return seen


@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, None)])
def test_an_interrupt_stops_cleanly_with_exit_130_and_no_partial_tables(tmp_path: Path, first: signal.Signals,
                                                                        second: signal.Signals | None) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 12 * 2**20, connections=8, segment_bytes=4 * 2**20)
    process = _start(tmp_path, stats.path)
    try:
        seen = _wait_for(process, "analyze: decoding frames")
        time.sleep(1.0)
        process.send_signal(first)
        if second is not None:
            time.sleep(0.01)
            process.send_signal(second)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = seen + stderr
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr + stdout and "Py4J" not in stderr and "KeyboardInterrupt" not in stderr
    assert f"interrupted ({first.name}): no table written" in stderr
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir()), "nothing half-written is left"


@pytest.mark.slow
def test_a_one_gib_recording_with_256_mib_segments_is_analysed(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 2**30, connections=400, segment_bytes=256 * 2**20)
    started = time.monotonic()
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"), "--master", "local[2]", timeout=3600)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"1 GiB analysed in {elapsed:.1f} s")
    messages = pq.read_table(tmp_path / "out" / "messages", columns=["sequence_id"]).num_rows
    assert messages == stats.messages
    shutil.rmtree(tmp_path / "in")


def test_urls_are_read_and_written_through_hadoop_with_the_same_tables(
        analyzed: tuple[Path, SyntheticStats, Path, Path], tmp_path: Path) -> None:
    """file:/// URLs take the path hdfs:// and s3a:// take: binaryFile in, Spark's Parquet writer out."""
    out, _stats, damaged, _base = analyzed
    # URL in and out; then URL in, path out (the tasks stage and write what Spark read)
    done = analyze(damaged.as_uri(), "--out", (tmp_path / "out").as_uri(), "--master", "local[2]", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Skipped input" in done.stdout
    mixed = analyze(damaged.as_uri(), "--out", str(tmp_path / "mixed"), "--master", "local[2]", "--quiet")
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    for name in TABLES:
        if name == "throughput":
            continue  # per topic and second: mixes both recordings of the fixture
        local = Counter(row for row in as_rows(out, name).elements() if dict(row).get("recording") == damaged.name)
        assert as_rows(tmp_path / "out", name) == local, name
        assert as_rows(tmp_path / "mixed", name) == local, name


def _run_pipeline(master: str, recording: str, out: Path, settings: str = "") -> None:
    """run_pipeline on ``master`` in a process of its own, as the CLI runs it: the driver's JVM goes with it."""
    script = ("import sys\n"
              "import proxy.analytics.pipeline as pipeline\n"
              "from proxy.analytics.spark import spark_session\n"
              f"{settings}\n"
              f"with spark_session({master!r}) as spark:\n"
              "    pipeline.run_pipeline(spark, [sys.argv[1]], sys.argv[2], split_bytes=150_000)\n")
    done = subprocess.run([sys.executable, "-c", script, recording, str(out)], capture_output=True, text=True,
                          timeout=SPARK_TIMEOUT, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 1 MiB recording of six connections (chunks, replication), and the tables one process writes of it."""
    base = tmp_path_factory.mktemp("small")
    stats = write_synthetic_recording(base / "in", 2**20, connections=6, segment_bytes=400_000,
                                      features=Features(chunked=True, replication=True))
    analyze_in_process([str(stats.path)], str(base / "one"), split_bytes=150_000)
    return stats.path, base / "one"


def test_many_edge_rows_are_shuffled_by_connection_with_the_same_tables(small: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """Past DRIVER_EDGE_ROWS the second step runs as Spark tasks after a shuffle of the edge rows: same tables.

    (Read by URL: local paths on a local master take the one-job plan, which has no shuffle.)
    """
    recording, one = small
    _run_pipeline("local[2]", recording.as_uri(), tmp_path / "spark", "pipeline.DRIVER_EDGE_ROWS = 0")
    for name in TABLES:
        assert as_rows(tmp_path / "spark", name) == as_rows(one, name), name


def test_the_one_job_plan_and_the_plan_of_three_jobs_write_the_same_tables(small: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    """local[3]: three barrier tasks share the splits and the connections, every staged row spilled to files
    (HELD_BYTES 0); local[2,2] (a master that retries tasks): decoding, pairing and writing as jobs of their own."""
    recording, one = small
    _run_pipeline("local[3]", str(recording), tmp_path / "barrier", "pipeline.HELD_BYTES = 0")
    _run_pipeline("local[2,2]", str(recording), tmp_path / "jobs")
    for name in TABLES:
        assert as_rows(tmp_path / "barrier", name) == as_rows(one, name), name
        assert as_rows(tmp_path / "jobs", name) == as_rows(one, name), name


def test_split_claims_give_every_split_to_exactly_one_task_largest_first(tmp_path: Path) -> None:
    """Three tasks taking turns unevenly (one takes three splits while the others take one) share every split."""
    from proxy.analytics.pipeline import SplitClaims

    sizes = [5, 9, 9, 1, 7, 3, 8]
    tasks = [iter(SplitClaims(str(tmp_path / "claims"), sizes)) for _ in range(3)]
    taken: list[list[int]] = [[], [], []]
    order: list[int] = []
    live = [0, 1, 2]
    while live:
        for task in list(live):
            for _ in range(3 if task == 0 else 1):
                split = next(tasks[task], None)
                if split is None:
                    live.remove(task)
                    break
                taken[task].append(split)
                order.append(split)
    assert sorted(order) == list(range(len(sizes)))
    assert order == sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)), "largest first, ties by index"
    assert len(taken[0]) > len(taken[1]), "the task that asks more often gets more"


@pytest.mark.parametrize("tasks", [1, 2, 3, 7])
def test_each_connection_is_finished_by_exactly_one_task(tasks: int) -> None:
    import pyarrow as pa

    from proxy.analytics.pipeline import connection_owners

    edges = pa.table({"recording": ["a", "b", "a", "b", "a", "c"] * 50, "conn_id": list(range(6)) * 50,
                      "seq": list(range(300))})
    owners = connection_owners(edges, tasks).tolist()
    assert len(owners) == 300 and set(owners) <= set(range(tasks))
    owner_of: dict[tuple[str, int], set[int]] = {}
    for recording, conn_id, owner in zip(edges["recording"].to_pylist(), edges["conn_id"].to_pylist(), owners,
                                         strict=True):
        owner_of.setdefault((recording, conn_id), set()).add(owner)
    assert all(len(tasks_of) == 1 for tasks_of in owner_of.values())


def test_connections_numbered_in_a_pattern_are_dealt_evenly() -> None:
    """Every fourth connection a consumer's (no SEND rows), as in the synthetic recordings: two tasks get
    about as many producers each (dealt by ``key % 2``, one got 50 and the other 25)."""
    import pyarrow as pa

    from proxy.analytics.pipeline import connection_owners

    producers = [conn_id for conn_id in range(1, 101) if conn_id % 4]
    owners = connection_owners(pa.table({"recording": ["20251122T093320Z-1"] * 75, "conn_id": producers}), 2)
    assert 30 <= sum(owners.tolist()) <= 45


def test_connections_finished_apart_give_the_rows_and_answers_of_all_finished_together(tmp_path: Path) -> None:
    """What the one-job plan's tasks do: each finishes the connections it owns and answers the topic look-ups of
    every other from its control frames only; together they make the rows and answers of one finisher of all."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from proxy.analytics import tables as tb
    from proxy.analytics.connections import TimeWindow, finish_connections
    from proxy.analytics.inputs import local_segments
    from proxy.analytics.pipeline import connection_owners
    from proxy.analytics.segments import plan_splits
    from proxy.analytics.steps import decode_local_split

    stats = write_synthetic_recording(tmp_path, 2**20, connections=9, segment_bytes=300_000,
                                      features=Features(chunked=True, replication=True))
    edges = pa.concat_tables([decode_local_split(split).edges
                              for split in plan_splits(local_segments([str(stats.path)]), 100_000)])
    whole = finish_connections(edges, TimeWindow())
    owners = connection_owners(edges, 3)
    is_send = pc.equal(edges["edge"], tb.EDGE_SEND).to_numpy(zero_copy_only=False)
    parts = [finish_connections(edges.filter(owners == task), TimeWindow(),
                                others=edges.filter((owners != task) & ~is_send)) for task in range(3)]
    for name in ("frames", "requests", "messages", "errors"):
        together: Counter[tuple[Any, ...]] = Counter()
        for part in parts:
            together.update(tuple(sorted(row.items())) for row in getattr(part, name).to_pylist())
        assert together == Counter(tuple(sorted(row.items())) for row in getattr(whole, name).to_pylist()), name
    assert all(sorted(part.resolution, key=repr) == sorted(whole.resolution, key=repr) for part in parts)
    assert len({answer[1] for answer in whole.resolution}) == 9 and whole.requests.num_rows > 100


@pytest.mark.parametrize("tasks", [1, 2, 4, 64])
def test_splits_are_dealt_into_tasks_of_about_equal_bytes(tasks: int) -> None:
    """The plain steps' task groups: every split exactly once, at most ``tasks`` groups, each in split order,
    and no group heavier than the lightest by more than the largest split."""
    from proxy.analytics.pipeline import task_groups

    sizes = [8 << 20] * 12 + [4_400_000, 3, 9 << 20, 1 << 20]
    groups = task_groups(sizes, tasks)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert len(groups) == min(tasks, len(sizes)) and all(group == sorted(group) for group in groups)
    loads = [sum(sizes[i] for i in group) for group in groups]
    assert max(loads) - min(loads) <= max(sizes)
    assert task_groups([], tasks) == []


@pytest.mark.parametrize("tasks", [1, 2, 3, 40])
def test_tapered_splits_cover_the_same_bytes_with_the_last_claimed_ones_cut_small(tasks: int) -> None:
    """The one-job plan's splits: every byte of every segment in exactly one split, ids in segment order,
    and the ``tasks`` splits a largest-first claimer takes last cut in four (so tasks end their decoding together)."""
    from proxy.analytics.segments import plan_splits, taper_splits

    segments = [("r", "segment-000001.ptap", "one", 32 << 20), ("r", "segment-000002.ptap", "two", 4 << 20),
                ("q", "segment-000001.ptap", "three", 17 << 20), ("q", "segment-000002.ptap", "four", 2)]
    planned = plan_splits(segments, 8 << 20)
    tapered = taper_splits(planned, tasks)
    assert [split.split_id for split in tapered] == list(range(len(tapered)))
    for location in ("one", "two", "three", "four"):
        ranges = [(s.start, s.end) for s in tapered if s.location == location]
        size = next(s.size for s in planned if s.location == location)
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(end == next_start for (_, end), (next_start, _) in itertools.pairwise(ranges))
    if tasks == 1:
        assert tapered == planned
        return
    smallest = sorted(planned, key=lambda s: (-(s.end - s.start), s.split_id))[-tasks:]
    pieces = sum(min(4, s.end - s.start) for s in smallest)  # (a split of fewer than four bytes: a piece a byte)
    assert len(tapered) == len(planned) - len(smallest) + pieces
    largest_piece = max(-(-(s.end - s.start) // 4) for s in smallest)
    claim_order = sorted(tapered, key=lambda s: (-(s.end - s.start), s.split_id))
    assert all(s.end - s.start <= largest_piece for s in claim_order[-pieces:])
