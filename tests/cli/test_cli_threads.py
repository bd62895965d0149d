"""numpy's BLAS keeps to one thread in pulsar-tap's server processes and the pytest plugin's proxy process
(proxy.native_threads): its thread pool (a thread per core) spun on the cores the relays need as the process started,
and the observer hub charged it to telemetry's share; a user's own ``OPENBLAS_NUM_THREADS`` is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tap_process import TapProcess

from proxy.testing import Tap

COMMANDS = {
    "run": ("run", "--listen", "127.0.0.1:0", "--upstream", "pulsar://127.0.0.1:1"),
    "broker": ("broker", "--listen", "127.0.0.1:0"),
}


def blas_setting(patched: pytest.MonkeyPatch, setting: str | None) -> None:
    """``OPENBLAS_NUM_THREADS`` set to ``setting`` (None: unset), ``OMP_NUM_THREADS`` unset."""
    patched.delenv("OMP_NUM_THREADS", raising=False)
    if setting is None:
        patched.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        patched.setenv("OPENBLAS_NUM_THREADS", setting)


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def threads_once_ready(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, setting: str | None) -> int:
    """The threads of a ``python -m proxy ARGV`` process once it listens, with the BLAS variables so."""
    with monkeypatch.context() as patched:
        blas_setting(patched, setting)
        process = TapProcess(*argv)
    try:
        process.wait_for("^ready: listening on ")
        time.sleep(0.3)  # (past the start's short-lived work)
        return threads(process.proc.pid)
    finally:
        process.stop()


COUNTED = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                             reason="threads are counted in /proc (Linux); BLAS starts none on one core")


@COUNTED
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_server_process_runs_numpys_blas_on_one_thread_unless_the_user_asks_for_more(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    unset = threads_once_ready(COMMANDS[command], monkeypatch, None)
    one = threads_once_ready(COMMANDS[command], monkeypatch, "1")
    two = threads_once_ready(COMMANDS[command], monkeypatch, "2")
    assert unset == one
    assert two > one  # (the count sees BLAS's threads: a user's setting is kept)


def tap_child_threads(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> int:
    """Threads of a ``Tap(process=True)``'s child (the pytest plugin's proxy) once it listens."""
    with monkeypatch.context() as patched:
        blas_setting(patched, setting)
        with Tap("pulsar://127.0.0.1:1", process=True) as tap:
            time.sleep(0.3)  # (past the start's short-lived work)
            return threads(tap._backend._process.pid)  # type: ignore[union-attr]


@COUNTED
def test_a_tap_in_a_child_process_runs_numpys_blas_on_one_thread_unless_the_user_asks_for_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    unset, two = tap_child_threads(monkeypatch, None), tap_child_threads(monkeypatch, "2")
    assert unset == tap_child_threads(monkeypatch, "1")
    assert two > unset
