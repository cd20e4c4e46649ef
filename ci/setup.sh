#!/usr/bin/env bash
# One command from a fresh clone: the virtual environment (.venv), xpnn installed in it with its
# test extras and PyTorch's CPU build (the torch backend); Fashion-MNIST from Debian's package
# where the package manager can install it, and as root Slurm's (the cluster tests); then the
# main job (2 ranks, 3 epochs). `--no-run` stops after the set-up (ci/test.sh uses it).
# Every command runs from .venv/bin by its path: an unactivated shell still finds mpiexec.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=1
[ "${1:-}" = "--no-run" ] && RUN=0
VENV="$PWD/.venv"
DATA=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

echo "== virtual environment: $VENV"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test]"
# The torch backend and its tests: PyTorch's CPU build, named exactly (a bare `torch` would pull
# the CUDA build and its libraries, gigabytes a CPU machine never uses)
"$VENV/bin/python" -m pip install -q "torch==2.13.0" "array-api-compat>=1.9"
[ -x "$VENV/bin/mpiexec" ] || { echo "setup: mpiexec missing after install (mpich wheel)" >&2; exit 1; }

echo "== Fashion-MNIST (Debian's dataset-fashion-mnist)"
if [ -f "$DATA" ]; then
  echo "already installed"
elif command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; }; then
  AS_ROOT=""; [ "$(id -u)" -eq 0 ] || AS_ROOT="sudo -n"
  $AS_ROOT apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $AS_ROOT apt-get install -y -qq dataset-fashion-mnist
else
  echo "note: no apt-get with root rights here; xpnn downloads Fashion-MNIST on first use"
fi

echo "== Slurm and munge for tests/cluster (Debian's packages)"
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  echo "already installed"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then  # the cluster runs as root
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
else
  echo "note: not root with apt-get here; the cluster tests skip, saying why"
fi

if [ "$RUN" -eq 1 ]; then
  echo "== the main job: 2 ranks, Fashion-MNIST, 3 epochs"
  "$VENV/bin/mpiexec" -n 2 "$VENV/bin/python" -m xpnn --dataset fashion-mnist --epochs 3
fi
