"""Every benchmark under ``bench/`` starts and explains itself: ``--help`` exits 0 with its usage.

The benchmarks are how #17's figures are taken, and nobody runs them in CI; a script that cannot
even print its help (an unescaped ``%`` in an argparse help text, an import that moved) is found here
rather than by the next person who needs its figures.  Each runs from a directory outside the checkout,
as a user may run it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def load_interleave() -> ModuleType:
    """bench/interleave.py as a module of its own (bench/ is no package, and putting it on sys.path would let
    its scripts shadow modules of the same name)."""
    spec = importlib.util.spec_from_file_location("bench_interleave", ROOT / "bench" / "interleave.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_each_rounds_ratio_pairs_the_arm_with_the_baseline_of_the_same_round() -> None:
    """A round the machine slowed down slows both arms of it: the ratio is the baseline's cost over the arm's in
    that round (above 1: the arm costs less), and the median and quartiles are of those ratios, not of the costs
    (the best of each arm, 10 and 8 here, would read 1.25)."""
    interleave = load_interleave()
    ratios = interleave.paired_ratios([10.0, 20.0, 10.0, 40.0], [10.0, 25.0, 8.0, 40.0])
    assert ratios == [1.0, 0.8, 1.25, 1.0]
    assert interleave.median_and_quartiles(ratios) == pytest.approx((1.0, 0.95, 1.0625))
    assert interleave.median_and_quartiles([0.9]) == (0.9, 0.9, 0.9)
    with pytest.raises(ValueError, match="3 baseline rounds against 2"):
        interleave.paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0])
