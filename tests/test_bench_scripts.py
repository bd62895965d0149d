"""Every benchmark under ``bench/`` starts and explains itself: ``--help`` exits 0 with its usage.

The benchmarks are how #17's figures are taken, and nobody runs them in CI; a script that cannot
even print its help (an unescaped ``%`` in an argparse help text, an import that moved) is found here
rather than by the next person who needs its figures.  Each runs from a directory outside the checkout,
as a user may run it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_the_telemetry_split_accounts_each_part(tmp_path: Path) -> None:
    """``telemetry.py --mode split`` runs every variant and prints a row for each (a variant that broke, e.g. a
    part renamed in ProxyMetrics, raises rather than printing)."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "telemetry.py"), "--mode", "split", "--messages",
                             "200", "--repeat", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line[:32].strip() for line in result.stdout.splitlines()}
    assert {"all of it", "lanes called directly", "histogram record", "request (label, key, record)",
            "frame counters", "message_count", "all three metrics calls"} <= rows
