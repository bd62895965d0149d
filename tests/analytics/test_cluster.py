"""``analyze`` on a real Spark standalone cluster: a master and two workers on loopback.

The cluster is started from the installed pyspark's own classes (``spark-class
org.apache.spark.deploy.master.Master`` / ``...worker.Worker``), used by
``pulsar-tap analyze --master spark://127.0.0.1:PORT`` and by the spark-submit example
in ``deploy/spark/``, and stopped by PID.  Both must write the tables local mode writes.

Marked ``slow``: a cluster, two applications and their executors take 3-6 minutes on the
shared 2-core machine (run with ``pytest -m slow tests/analytics``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from proxy.analytics.steps import analyze_in_process
from proxy.analytics.synthetic import Features, write_synthetic_recording

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TABLES = ("frames", "requests", "messages", "errors", "throughput", "replication")
ENV = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_MASTER_HOST": "127.0.0.1",
       "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.3)
    raise AssertionError(f"{text!r} not in {log}: {log.read_text(errors='replace')[-3000:]}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``spark://127.0.0.1:PORT`` of a master with two one-core workers; every process stopped by PID."""
    logs = tmp_path_factory.mktemp("spark-cluster")
    port = free_port()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        master_log = logs / "master.log"
        with open(master_log, "wb") as sink:
            processes.append(subprocess.Popen(
                [str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                 "--port", str(port), "--webui-port", str(free_port())],
                stdout=sink, stderr=subprocess.STDOUT, env=ENV))
        wait_for(master_log, "I have been elected leader", processes[0])
        url = f"spark://127.0.0.1:{port}"
        for index in range(2):
            log = logs / f"worker-{index}.log"
            with open(log, "wb") as sink:
                processes.append(subprocess.Popen(
                    [str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                     "--cores", "1", "--memory", "1500m", "--webui-port", str(free_port()),
                     "--work-dir", str(logs / f"work-{index}")],
                    stdout=sink, stderr=subprocess.STDOUT, env=ENV))
            wait_for(log, "Successfully registered with master", processes[-1])
        yield url
    finally:
        for process in reversed(processes):
            stop(process)


def rows(out: Path, name: str) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(sorted(r.items())) for r in pq.read_table(out / name).to_pylist())


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A recording split in many tasks, and the tables one process writes for it (= local mode's)."""
    base = tmp_path_factory.mktemp("recordings")
    stats = write_synthetic_recording(base, 6 * 2**20, connections=10, segment_bytes=2 * 2**20,
                                      features=Features(chunked=True, replication=True))
    expected = tmp_path_factory.mktemp("expected")
    analyze_in_process([str(stats.path)], str(expected), split_bytes=2**20)
    return stats.path, expected


@pytest.mark.slow
def test_analyze_on_a_standalone_cluster_writes_the_local_tables(cluster: str, recording: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    path, expected = recording
    done = subprocess.run([sys.executable, "-m", "proxy", "analyze", str(path), "--out", str(tmp_path / "out"),
                           "--master", cluster, "--split-mb", "1"], capture_output=True, text=True, env=ENV,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    for name in TABLES:
        assert rows(tmp_path / "out", name) == rows(expected, name), name


@pytest.mark.slow
def test_the_spark_submit_example_runs_on_the_cluster(cluster: str, recording: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    """deploy/spark/README.md's spark-submit command, as written there."""
    path, expected = recording
    done = subprocess.run([str(BIN / "spark-submit"), "--master", cluster,
                           "--conf", f"spark.pyspark.python={sys.executable}",
                           str(ROOT / "deploy" / "spark" / "analyze_job.py"), str(path), "--out", str(tmp_path / "out"),
                           "--quiet"], capture_output=True, text=True, env=ENV, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Request latency" in done.stdout
    for name in TABLES:
        assert rows(tmp_path / "out", name) == rows(expected, name), name


@pytest.mark.slow
def test_the_cluster_executors_run_the_compiled_decoder(cluster: str) -> None:
    """The workers' Python (the same venv) imports the decoder scripts/setup.sh compiled, not its source."""
    script = ("import proxy.compiled as compiled\n"
              "from proxy.analytics.spark import spark_session\n"
              "def states(_):\n"
              "    import proxy.analytics.decode\n"
              "    yield (tuple(sorted(compiled.states_of('proxy.analytics').items())),\n"
              "           compiled.is_compiled(proxy.analytics.decode))\n"
              f"with spark_session({cluster!r}) as spark:\n"
              "    print(set(spark.sparkContext.parallelize(range(4), 4).mapPartitions(states).collect()))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "{((('proxy.analytics.decode', 'compiled'),), True)}", done.stdout
