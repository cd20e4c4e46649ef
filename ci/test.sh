#!/usr/bin/env bash
# The test command of README.md: lint, format check, the user guide (a broken link or a page
# missing from mkdocs.yml's nav fails), then the whole test suite (CPU backends, real mpiexec
# runs, real Fashion-MNIST). GPU tests skip, saying why, where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
site="$(mktemp -d)"
mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
python -m pytest -q -ra "$@"
