#!/usr/bin/env bash
# The test command: installs what is missing, then lint, type check and the test suite.
#   bash scripts/test.sh            (extra arguments go to pytest, e.g. -k codec)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff" && .venv/bin/ruff check proxy tests bench
echo "== mypy" && .venv/bin/mypy
echo "== pytest" && .venv/bin/python -m pytest -q "$@"
