#!/usr/bin/env bash
# The test command: installs what is missing, then lint, type check and the test suite.
#   bash scripts/test.sh            (extra arguments go to pytest, e.g. -k codec)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff" && .venv/bin/ruff check proxy tests bench
echo "== mypy" && .venv/bin/mypy
# two worker processes, a test file each at a time (pytest-xdist): most tests wait on sockets, JVMs
# and subprocesses, so two take ~0.6x the wall time of one on 2 cores; `-n 0` (given last) runs in one
echo "== pytest" && .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
