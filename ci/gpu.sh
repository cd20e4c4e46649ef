#!/usr/bin/env bash
# Every GPU check in one call, for a machine with an NVIDIA GPU (CuPy, mpi4py, Numba present):
# GPU tests, 2-rank --backend cupy training runs (data, tensor, pipeline parallel), the crossover,
# allreduce, staging and throughput benchmarks. Results go to ${OUT:-bench/results}.
# Usage: bash ci/gpu.sh (wheels in .whl/, if any, are installed first: see README, GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0
step() { echo; echo "== $*"; }
run() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }

if compgen -G ".whl/*.whl" >/dev/null; then
  # What the image lacks, carried as wheels (README: GPU): installed under a prefix, found
  # wherever this pip's scheme put them (Debian's adds local/), and put first.
  step "wheels from .whl/"
  P=/tmp/xpnn-wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix "$P" .whl/*.whl \
    || { echo "FAILED: pip install .whl/*.whl"; exit 1; }
  SITE="$(find "$P" -maxdepth 5 -type d -name '*-packages' | head -1)"
  BIN="$(find "$P" -maxdepth 3 -type f -name mpiexec | head -1)"
  LIBMPI="$(find "$P" -maxdepth 4 -name 'libmpi.so.12' | head -1)"
  [ -n "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
  [ -n "$BIN" ] && export PATH="$(dirname "$BIN"):$PATH"
  [ -n "$LIBMPI" ] && export MPI4PY_LIBMPI="$LIBMPI"  # mpi4py's ABI build loads this MPI
  echo "site $SITE, mpiexec ${BIN:-none}, MPI4PY_LIBMPI ${LIBMPI:-unset}"
fi

step "environment"
nvidia-smi -L || true
run "$PY" -m xpnn info

step "GPU tests"
run "$PY" -m pytest -q -ra tests/gpu tests/test_backends.py tests/test_layers.py

MPIEXEC="$(command -v mpiexec || true)"
step "2-rank --backend cupy training run"
if [ -n "$MPIEXEC" ]; then
  run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --dataset synthetic --synthetic-size 20000 \
      --epochs 3 --batch-size 512 --metrics "$OUT/gpu_train.jsonl" --no-progress
  for parallel in tensor pipeline; do
    run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --parallel "$parallel" --dataset synthetic \
        --synthetic-size 20000 --epochs 2 --batch-size 512 --no-progress
  done
  for comm in mpi-host mpi-cuda nccl; do
    run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --comm "$comm" --dataset synthetic \
        --synthetic-size 4000 --epochs 1 --no-progress
  done
else
  echo "skipped: no mpiexec on this machine (pip install mpich)"; status=1
fi

step "matmul crossover"
run "$PY" bench/matmul_crossover.py --out "$OUT/crossover.jsonl"

step "allreduce (device buffers)"
if [ -n "$MPIEXEC" ]; then
  run "$PY" -m bench allreduce --device --out "$OUT/allreduce_gpu.jsonl"
fi

step "host staging of device buffers, phase by phase (1 rank, then 2 ranks)"
if [ -n "$MPIEXEC" ]; then
  run "$MPIEXEC" -n 1 "$PY" bench/staging.py
  run "$MPIEXEC" -n 2 "$PY" bench/staging.py
fi

step "throughput (cupy vs PyTorch CUDA)"
run "$PY" bench/throughput.py --backends cupy --batches 128,512 --json "$OUT/throughput_gpu.json"
run "$PY" bench/throughput.py --model cnn --backends cupy --batches 128 --json "$OUT/throughput_cnn_gpu.json"

echo; [ $status -eq 0 ] && echo "ci/gpu.sh: all GPU checks passed" || echo "ci/gpu.sh: some checks FAILED"
exit $status
