"""numpy's BLAS keeps to one thread in pulsar-tap's server processes (proxy.native_threads): its thread
pool (a thread per core) spun on the cores the relays need as the process started, and the observer hub
charged it to telemetry's share; a user's own ``OPENBLAS_NUM_THREADS`` is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tap_process import TapProcess

COMMANDS = {
    "run": ("run", "--listen", "127.0.0.1:0", "--upstream", "pulsar://127.0.0.1:1"),
    "broker": ("broker", "--listen", "127.0.0.1:0"),
}


def threads_once_ready(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, setting: str | None) -> int:
    """The threads of a ``python -m proxy ARGV`` process once it listens, with ``OPENBLAS_NUM_THREADS`` set
    so (None: unset, and ``OMP_NUM_THREADS`` too)."""
    with monkeypatch.context() as patched:
        patched.delenv("OMP_NUM_THREADS", raising=False)
        if setting is None:
            patched.delenv("OPENBLAS_NUM_THREADS", raising=False)
        else:
            patched.setenv("OPENBLAS_NUM_THREADS", setting)
        process = TapProcess(*argv)
    try:
        process.wait_for("^ready: listening on ")
        time.sleep(0.3)  # (past the start's short-lived work)
        return len(list(Path(f"/proc/{process.proc.pid}/task").iterdir()))
    finally:
        process.stop()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                    reason="threads are counted in /proc (Linux); BLAS starts none on one core")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_server_process_runs_numpys_blas_on_one_thread_unless_the_user_asks_for_more(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    unset = threads_once_ready(COMMANDS[command], monkeypatch, None)
    one = threads_once_ready(COMMANDS[command], monkeypatch, "1")
    two = threads_once_ready(COMMANDS[command], monkeypatch, "2")
    assert unset == one
    assert two > one  # (the count sees BLAS's threads: a user's setting is kept)
