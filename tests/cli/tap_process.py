"""``pulsar-tap`` commands run as real processes, for tests that send them real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class TapProcess:
    """One ``python -m proxy ...`` process; its stdout and stderr are collected line by line on threads."""

    def __init__(self, *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        # (PYTHONPATH: from any ``cwd``, the tree under test, not the venv's editable install's)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT, env=full_env)
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True)
                         for name in ("stdout", "stderr")]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = self.proc.stdout if name == "stdout" else self.proc.stderr
        assert stream is not None
        for line in stream:
            with self._changed:
                self.lines[name].append(line.rstrip("\n"))
                self._changed.notify_all()

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines["stdout"])

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines["stderr"])

    def wait_for(self, pattern: str, stream: str = "stdout", timeout: float = 60.0) -> str:
        """The first line of ``stream`` matching ``pattern`` (a regex), waiting for it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[stream]:
                    if regex.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._more_to_read()):
                    raise AssertionError(f"no line matching {pattern!r} on {stream} of pulsar-tap "
                                         f"{' '.join(self.argv)}:\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}")
                self._changed.wait(min(left, 0.2))

    def _more_to_read(self) -> bool:
        return any(reader.is_alive() for reader in self._readers)

    def send(self, *signals: int, gap: float = 0.01) -> None:
        """Send the signals in turn, ``gap`` seconds apart (``kill -INT P; sleep 0.01; kill -INT P``)."""
        for index, signum in enumerate(signals):
            if index:
                time.sleep(gap)
            if self.proc.poll() is None:
                self.proc.send_signal(signum)

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the process to end (killing it after ``timeout``) and for its output to be read."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"pulsar-tap {' '.join(self.argv)} did not end within {timeout}s:\n"
                                 f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}") from None
        self._close()
        return code

    def _close(self) -> None:
        for reader in self._readers:
            reader.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def stop(self) -> None:
        """Kill the process if it still runs (a test's cleanup); close its pipes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close()


def no_traceback(process: TapProcess) -> bool:
    return "Traceback" not in process.stdout and "Traceback" not in process.stderr


__all__ = ["ROOT", "TapProcess", "no_traceback"]
