"""The users' example suite (tests/examples/) against the real Apache Pulsar broker.

tests/examples/ is written the way a user writes tests with the pytest plugin; by default its
taps front the embedded cluster.  Here it runs as a user runs it against their own broker —
``pytest tests/examples --pulsar-url URL`` in a process of its own — with the real standalone
as that broker.  Every example must pass unchanged: the faults, the throttle, the recordings'
assertions and the cassette (which replays with no broker either way).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from real_pulsar import Standalone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "examples"


def test_the_example_suite_passes_against_the_real_broker(real_pulsar: Standalone, tmp_path: Path) -> None:
    expected = len(re.findall(r"^(?:async )?def test_", "".join(
        path.read_text() for path in EXAMPLES.glob("test_*.py")), flags=re.MULTILINE))
    assert expected >= 5, "the example suite lost its tests"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(EXAMPLES), "-q", "-p", "no:cacheprovider",
         "--pulsar-url", real_pulsar.service_url, "--basetemp", str(tmp_path / "basetemp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"examples failed against the real broker:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert f"{expected} passed" in summary, summary
