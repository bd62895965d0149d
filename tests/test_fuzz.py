"""The fuzzer's 30-second mode, in the default suite: the split-frame family, then atheris.

``bench/fuzz.py`` (its docstring says what each target checks) first sweeps every
official-client frame cut everywhere that matters — the family of issue #12's one-frame
hang — then fuzzes the scanner, the codec and the relay pipeline with atheris for the
rest of the 30 seconds.  Any crash, mismatch between the scanner and FrameDecoder, or
input running over 5 s fails the test; the input is kept under the test's directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

FUZZ = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"


def test_thirty_seconds_of_fuzzing_find_no_crash_and_no_hang(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(FUZZ), "--seconds", "30", "--artifacts", str(tmp_path / "found")],
                          capture_output=True, text=True, timeout=300, check=False)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-3000:]
    sweep = re.search(r"split-frame sweep\s+([\d,]+)\s+0\s+0", report)
    fuzzed = re.search(r"atheris \(3 targets\)\s+([\d,]+)\s+0\s+0", report)
    assert sweep is not None and fuzzed is not None, report[-3000:]
    assert int(sweep[1].replace(",", "")) > 10_000
    assert int(fuzzed[1].replace(",", "")) > 1_000
    assert "no crash, no hang" in report
