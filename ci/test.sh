#!/usr/bin/env bash
# The test command of README.md: lint, format check, the benchmark suite's quick report, then
# the whole test suite (CPU backends, real mpiexec runs, real Fashion-MNIST), which also checks
# the import contracts (tests/test_architecture.py) and builds the user guide strictly
# (tests/test_docs.py). GPU tests skip, saying why, where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
# The benchmark suite's quick report: it builds, every table has rows, every PNG is valid.
REPORT_DIR="$(mktemp -d)"
trap 'rm -rf "$REPORT_DIR"' EXIT
python -m bench report --quick --out "$REPORT_DIR" >/dev/null
python -m bench report --check --out "$REPORT_DIR"
python -m pytest -q -ra "$@"
