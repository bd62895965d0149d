"""Every benchmark under ``bench/`` starts and explains itself: ``--help`` exits 0 with its usage.

The benchmarks are how #17's figures are taken, and nobody runs them in CI; a script that cannot
even print its help (an unescaped ``%`` in an argparse help text, an import that moved) is found here
rather than by the next person who needs its figures.  Each runs from a directory outside the checkout,
as a user may run it.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: modules of bench/ the scripts import, not scripts
LIBRARIES = frozenset({"interleave.py"})
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py") if path.name not in LIBRARIES)


def test_the_benchmarks_are_found() -> None:
    assert {"passthrough.py", "telemetry.py", "replay.py", "rules.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_prints_its_help(script: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_the_telemetry_split_accounts_each_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``telemetry.py --mode split`` runs every variant and prints a row for each (a variant that broke, e.g. a
    part renamed in ProxyMetrics, raises rather than printing)."""
    variants = set(load_bench("telemetry", monkeypatch).SPLIT_VARIANTS)
    assert {"all of it", "lanes called directly", "histogram record", "both metrics calls"} <= variants
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "telemetry.py"), "--mode", "split", "--messages",
                             "200", "--repeat", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line[:32].strip() for line in result.stdout.splitlines()}
    assert variants <= rows


def test_the_telemetry_bench_runs_the_proxy_as_a_process_and_hears_back_from_it(tmp_path: Path) -> None:
    """``telemetry.py --mode proxy``: the proxy of each arm runs as a process of its own (``--serve-proxy``), the
    official client's messages go through it, and what only that process knows comes back once it has ended:
    the events its hub dropped and the spans it exported (one a message at 100 %, a warm-up's among them)."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "telemetry.py"), "--mode", "proxy", "--arms",
                             "off,traces-100%", "--messages", "200", "--repeat", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the proxy, the broker and the client each a process" in result.stdout
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if " dropped " in line}
    assert lines["off"].endswith("dropped 0 spans 0"), lines
    dropped, spans = lines["traces-100%"].split("dropped ")[1].split(" spans ")
    assert dropped == "0" and int(spans) >= 200, lines


def test_the_replay_bench_records_through_a_proxy_process_and_replays_the_recording(tmp_path: Path) -> None:
    """``replay.py``: ``pulsar-tap run`` with and without ``--record`` beside a ``pulsar-tap broker``, each a
    process; the recording the last round's proxy left is served and replayed without a difference."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "replay.py"), "--messages", "300", "--rounds", "1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the proxy (pulsar-tap run), the broker (pulsar-tap broker) and the client each a process" in result.stdout
    assert "broker-side replay (served):" in result.stdout and "(300 messages in" in result.stdout
    assert "; 0 diffs" in result.stdout


def load_bench(script: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/SCRIPT.py as a module, with bench/ on sys.path for the test only (its scripts import their library,
    interleave.py, from there, as when run; for no longer, or bench's own proxy.py could shadow the package)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{script}", ROOT / "bench" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_an_observer_phase_begins_once_the_arms_are_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait_for_quiet`` watches the arms' CPU window by window and returns after the first window in which they
    used less than QUIET_CORES: what one arm left running (span exports) is not run in the next arm's phase."""
    passthrough = load_bench("passthrough", monkeypatch)
    window = passthrough.QUIET_WINDOW_S
    # CPU seconds of the one process read before and after each window: 0.8 cores, then 0.4, then none
    readings = iter([0.0, 0.8 * window, 0.8 * window, 1.2 * window, 1.2 * window, 1.2 * window])
    monkeypatch.setattr(passthrough, "proxy_cpu_seconds", lambda pid: next(readings))
    windows: list[float] = []
    monkeypatch.setattr(passthrough.time, "sleep", windows.append)
    passthrough.wait_for_quiet([1234])
    assert windows == [window] * 3
    assert next(readings, None) is None


def test_an_observer_phase_begins_after_the_longest_wait_if_the_arms_stay_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arms that never settle hold a phase back QUIET_TIMEOUT_S at the most (and the wait says so)."""
    passthrough = load_bench("passthrough", monkeypatch)
    window = passthrough.QUIET_WINDOW_S
    used = iter(range(10_000))  # one CPU second per reading: always busy
    monkeypatch.setattr(passthrough, "proxy_cpu_seconds", lambda pid: float(next(used)))
    now = [0.0]
    monkeypatch.setattr(passthrough.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    monkeypatch.setattr(passthrough.time, "perf_counter", lambda: now[0])
    waited = passthrough.wait_for_quiet([1234])
    assert passthrough.QUIET_TIMEOUT_S <= waited < passthrough.QUIET_TIMEOUT_S + window


def test_each_rounds_ratio_pairs_the_arm_with_the_baseline_of_the_same_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round the machine slowed down slows both arms of it: the ratio is the baseline's cost over the arm's in
    that round (above 1: the arm costs less), and the median and quartiles are of those ratios, not of the costs
    (the best of each arm, 10 and 8 here, would read 1.25)."""
    interleave = load_bench("interleave", monkeypatch)
    ratios = interleave.paired_ratios([10.0, 20.0, 10.0, 40.0], [10.0, 25.0, 8.0, 40.0])
    assert ratios == [1.0, 0.8, 1.25, 1.0]
    assert interleave.median_and_quartiles(ratios) == pytest.approx((1.0, 0.95, 1.0625))
    assert interleave.median_and_quartiles([0.9]) == (0.9, 0.9, 0.9)
    with pytest.raises(ValueError, match="3 baseline rounds against 2"):
        interleave.paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


def test_arms_in_bursts_take_turns_and_a_failing_arm_leaves_the_round(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``interleave.in_bursts``: a burst through each arm in turn, each cycle in an order of its own (seeded:
    the same for the same seed and round, not one arm always after the same other); an arm's bursts add up
    to its round; an arm whose burst raised is left out of the round and said so, the others go on."""
    interleave = load_bench("interleave", monkeypatch)
    order: list[str] = []

    def burst(arm: str, fail_at: int = 0) -> Any:
        def send() -> int:
            order.append(arm)
            if fail_at and order.count(arm) == fail_at:
                raise TimeoutError("flush timed out")
            return 10
        return send

    parts = interleave.CpuParts(threading.get_native_id())
    steady = {arm: interleave.Lane(parts, burst(arm)) for arm in ("a", "b", "c")}
    interleave.in_bursts(steady, 12, 0)
    cycles = [order[index:index + 3] for index in range(0, 36, 3)]
    assert all(sorted(cycle) == ["a", "b", "c"] for cycle in cycles)
    assert len({tuple(cycle) for cycle in cycles}) > 1  # (not one order throughout)
    assert {cycle[cycle.index("a") - 1] for cycle in cycles if cycle[0] != "a"} == {"b", "c"}
    first = list(order)
    order.clear()
    interleave.in_bursts({arm: interleave.Lane(parts, burst(arm)) for arm in ("a", "b", "c")}, 12, 0)
    assert order == first
    order.clear()
    lanes = {arm: interleave.Lane(parts, burst(arm, 2 if arm == "c" else 0)) for arm in ("a", "b", "c")}
    results = interleave.in_bursts(lanes, 3, 1)
    assert order.count("c") == 2 and order.count("a") == order.count("b") == 3
    assert set(results) == {"a", "b"}
    assert results["a"].units == 30 and results["a"].rate > 0
    assert "c: round 2 failed: TimeoutError('flush timed out')" in capsys.readouterr().err


def test_the_python_floor_relays_both_ways_and_ends_both_sides_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency bench's floor path (loopback): what a client writes reaches the server and back, whole, and a
    client that leaves takes the server's connection with it."""
    passthrough = load_bench("passthrough", monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as server, passthrough.python_floor(server.getsockname()[1]) as (
            port, _pid):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            upstream, _ = server.accept()
            upstream.settimeout(10)
            for size in (1, 100, 300_000):
                data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                client.sendall(data)
                got = b""
                while len(got) < size:
                    got += upstream.recv(1 << 20)
                upstream.sendall(got)
                back = b""
                while len(back) < size:
                    back += client.recv(1 << 20)
                assert got == back == data
        assert upstream.recv(1) == b""  # the client left: the floor closed the server's side
        upstream.close()


def _stand_in(server: socket.socket, answer: bytes, accepted: list[int]) -> None:
    """Accept connections until the server closes; to each CONNECT (and SEND) answer ``answer``, then close."""
    while True:
        try:
            sock, _ = server.accept()
        except OSError:
            return
        with sock:
            accepted.append(1)
            sock.recv(65536)
            if answer:
                sock.sendall(answer)
                sock.recv(65536)  # (the client's close)


@pytest.mark.parametrize("send", [False, True])
def test_a_connection_storm_opens_every_connection_and_awaits_its_answers(send: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    connections = load_bench("connections", monkeypatch)
    passthrough = load_bench("passthrough", monkeypatch)
    answer = passthrough.CONNECTED + (passthrough.RECEIPT if send else b"")
    accepted: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=_stand_in, args=(server, answer, accepted), daemon=True)
        thread.start()
        assert connections.storm(server.getsockname()[1], 30, 5, send) > 0
    assert len(accepted) == 30


def test_a_connection_storm_fails_when_the_path_closes_a_connection_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that drops connections must not look fast: the storm raises rather than counting them done."""
    connections = load_bench("connections", monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=_stand_in, args=(server, b"", []), daemon=True).start()
        with pytest.raises(ConnectionError):
            connections.storm(server.getsockname()[1], 10, 2, False)
