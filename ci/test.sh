#!/usr/bin/env bash
# The test command of README.md: lint, format check, the import contracts (pyproject.toml), then
# the whole test suite (CPU backends, real mpiexec runs, real Fashion-MNIST). GPU tests skip,
# saying why, where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
lint-imports
python -m pytest -q -ra "$@"
