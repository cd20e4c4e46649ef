#!/usr/bin/env bash
# The test command of README.md (it sets up ./.venv with ci/setup.sh where no virtual
# environment is active and none is there): lint, format check, the benchmark suite's quick report, then
# the whole test suite (CPU backends, real mpiexec runs, real Fashion-MNIST), which also checks
# the import contracts (tests/test_architecture.py) and builds the user guide strictly
# (tests/test_docs.py). GPU tests skip, saying why, where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# An active virtual environment is used as it is; else ./.venv, set up first if it is missing.
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/mpiexec ] || bash ci/setup.sh --no-run
  export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
fi
ruff check .
ruff format --check .
# The benchmark suite's quick report: it builds, every table has rows, every PNG is valid.
REPORT_DIR="$(mktemp -d)"
trap 'rm -rf "$REPORT_DIR"' EXIT
python -m bench report --quick --out "$REPORT_DIR" >/dev/null
python -m bench report --check --out "$REPORT_DIR"
# Over the cores (at most 4 workers: most tests start 2-rank mpiexec jobs of their own), a
# test file to a worker, so its module fixtures and cached 1-rank runs are made once
PARALLEL=()
if python -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n auto --maxprocesses 4 --dist loadfile)
fi
python -m pytest -q -ra "${PARALLEL[@]}" "$@"
