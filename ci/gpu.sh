#!/usr/bin/env bash
# Every GPU check in one call, for a machine with an NVIDIA GPU (CuPy, Numba present):
#   1. --comm mpi-cuda on a really CUDA-aware MPI (the .cuda-mpi prefix that
#      ci/build-cuda-mpi.sh builds, carried here): 2 ranks on one GPU train without falling
#      back and save the same parameters as mpi-host (float64, 1e-10 relative);
#   2. the mpi-cuda GPU tests (device collectives; data parallel = mpi-host, tensor and
#      pipeline parallelism = 1 NumPy rank, over mpi-cuda) and detection against the library;
#   3. allreduce of device buffers, 4 B to 256 MiB: mpi-cuda vs mpi-host (pinned staging) on
#      2 ranks, and NCCL on 1 rank;
#   4. throughput against PyTorch CUDA (MLP 784-512-256-10 at batch 128 and 512, CNN at 128),
#      the CNN's step phases on the GPU, and the staging benchmark;
#   5. the other GPU tests, 2-rank training runs with each --comm and --parallel, the
#      crossover benchmark.
# Most telling first, so a run cut short still brought those back. Results, the log and the
# time of each step go to ${OUT:-bench/results}. Any mismatch or fallback fails the script.
# `bash ci/gpu.sh scaling-precision` runs only the 16-core CPU scaling studies and the mixed
# precision timings, --grad-dtype's included (its own lease of about 6 minutes;
# XPNN_GPU_BUDGET=330 keeps it there).
# On 2 loaded cores, with XPNN_SCALING_RANKS=1,2 and no GPU, its CPU steps took 143 s.
# `bash ci/gpu.sh graphs` runs only the CUDA graph tests and the graph timings beside PyTorch
# eager and compiled (its own lease of about 6 minutes; XPNN_GPU_BUDGET=330).
# Usage: bash ci/gpu.sh (wheels in .whl/, if any, are installed first: see docs/gpu.md; the
# prefix is taken from $XPNN_CUDA_MPI_PREFIX or .cuda-mpi/).
# Every command runs under `timeout` (XPNN_GPU_STEP_LIMIT, 240 s), so a hung collective costs
# minutes, not the lease; with XPNN_GPU_BUDGET=SECONDS, commands that would start after that
# much time are skipped and listed, so a lease of fixed length still brings the log back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
if [ -z "${XPNN_GPU_SH_LOGGED:-}" ]; then  # everything also into $OUT/gpu.log, exit code kept
  XPNN_GPU_SH_LOGGED=1 bash "$0" "$@" 2>&1 | tee "$OUT/gpu.log"
  exit "${PIPESTATUS[0]}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
failed=()
t_start=$(date +%s)
t_step=$t_start
step_name=""
end_step() {
  [ -n "$step_name" ] && echo "$step_name: $(($(date +%s) - t_step)) s" >>"$OUT/gpu_times.txt"
  t_step=$(date +%s)
}
step() { end_step; step_name="$*"; echo; echo "== $* ($(($(date +%s) - t_start)) s in)"; }
fail() { echo "FAILED: $*"; failed+=("$*"); }
skipped=()
STEP_LIMIT="${XPNN_GPU_STEP_LIMIT:-240}"
run() {  # COMMAND...: under a time limit, within the budget; a failure is recorded, not fatal
  local limit="$STEP_LIMIT"
  if [ -n "${XPNN_GPU_BUDGET:-}" ]; then
    local left=$((XPNN_GPU_BUDGET - ($(date +%s) - t_start)))
    if [ "$left" -lt 20 ]; then
      echo "SKIPPED (budget): $*"
      skipped+=("$*")
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit="$left"
  fi
  timeout -k 10 "$limit" "$@"
  local rc=$?
  [ "$rc" = 124 ] && echo "TIMED OUT after $limit s: $*"
  [ "$rc" = 0 ] || fail "($rc) $*"
}
: >"$OUT/gpu_times.txt"

if compgen -G ".whl/*.whl" >/dev/null; then
  # What the image lacks, carried as wheels (docs/gpu.md): installed under a prefix, found
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

if [ "${1:-all}" = "graphs" ]; then
  # The training step as a CUDA graph (--cuda-graph): its GPU tests (replayed = eager, MLP and
  # CNN, 1 and 2 ranks), then xpnn eager and replayed beside PyTorch eager and
  # torch.compile(mode="reduce-overhead"), MLP and CNN at batch 128 and 512: one run of about
  # 6 minutes (XPNN_GPU_BUDGET=330 keeps it there). Copy $OUT/graphs_*.jsonl into
  # bench/recorded/ afterwards; docs/gpu.md's graph table is filled from them.
  step "CUDA graph GPU tests: the replayed step against eager (MLP, CNN; 1 and 2 ranks)"
  run "$PY" -m pytest -q -ra tests/gpu/test_gpu_graph.py
  TP=(--backends cupy --batches 128,512 --graphs --torch-compile --repeats 3)
  step "throughput, MLP: xpnn eager and graph, PyTorch eager and compiled, batch 128 and 512"
  run "$PY" -m bench throughput "${TP[@]}" --out "$OUT/graphs_mlp.jsonl"
  step "throughput, CNN: xpnn eager and graph, PyTorch eager and compiled, batch 128 and 512"
  run "$PY" -m bench throughput --model cnn "${TP[@]}" --out "$OUT/graphs_cnn.jsonl"
  end_step
  echo "total: $(($(date +%s) - t_start)) s" >>"$OUT/gpu_times.txt"
  cat "$OUT/gpu_times.txt"
  if [ ${#skipped[@]} -gt 0 ]; then
    printf 'SKIPPED (budget): %s\n' "${skipped[@]}"
  fi
  [ ${#failed[@]} -eq 0 ] || { printf 'FAILED: %s\n' "${failed[@]}"; exit 1; }
  echo "ci/gpu.sh graphs: done"
  exit 0
fi

if [ "${1:-all}" = "scaling-precision" ]; then
  # The 16-core CPU scaling studies of seeds 000 (scaling), 002 (cnn) and 003 (granularity) at
  # 1-16 ranks, and mixed precision on CuPy beside fp32: one run of about 6 minutes. Copy
  # $OUT/scaling16_*.jsonl into bench/recorded/ afterwards (the report reads them there).
  RANKS="${XPNN_SCALING_RANKS:-1,2,4,8,16}"  # 1,2: the check of this step on a small machine
  CORES="$(nproc)"
  [ "$CORES" -ge 16 ] || echo "note: $CORES cores here, 16 ranks will share them"
  step "seed 000: strong and weak scaling at $RANKS ranks (CPU, 1 thread a rank)"
  run "$PY" -m bench scaling --ranks "$RANKS" --threads 1 --repeats 1 \
    --out "$OUT/scaling16_000.jsonl"
  step "seed 002: the CNN at $RANKS ranks, batch 128 a rank (CPU)"
  run "$PY" -m bench cnn --ranks "$RANKS" --threads 1 --repeats 1 --samples 6144 --epochs 1 \
    --out "$OUT/scaling16_002.jsonl"
  step "seed 003: granularity at $RANKS ranks (CPU)"
  run "$PY" -m bench granularity --ranks "$RANKS" --threads 1 --repeats 1 --widths 16,256,4096 \
    --out "$OUT/scaling16_003.jsonl"
  step "--precision fp32, bf16, fp16 on cupy: MLP at batch 512, CNN at batch 128"
  for model in mlp cnn; do
    batch=512; [ "$model" = cnn ] && batch=128
    for precision in fp32 bf16 fp16; do
      run "$PY" -m xpnn --backend cupy --model "$model" --precision "$precision" \
        --dataset synthetic --synthetic-size 12800 --epochs 2 --batch-size "$batch" \
        --no-progress --metrics "$OUT/precision_${model}_$precision.jsonl" \
        >"$OUT/precision_${model}_$precision.log" 2>&1
      tail -2 "$OUT/precision_${model}_$precision.log"
    done
  done
  # One GPU: the 2 ranks share it, so NCCL refuses them and the exchange is mpi-host's pinned
  # staging, the 16-bit sum a float32 MPI op on the host (NCCL's own sums need a GPU a rank).
  step "--grad-dtype float32, bfloat16, float16 on cupy: MLP at batch 512, 2 ranks (mpi-host)"
  for grad in float32 bfloat16 float16; do
    run "$(command -v mpiexec)" -n 2 "$PY" -m xpnn --backend cupy --comm mpi-host \
      --grad-dtype "$grad" --dataset synthetic --synthetic-size 12800 --epochs 2 \
      --batch-size 512 --no-progress --metrics "$OUT/grad_dtype_mlp_$grad.jsonl" \
      >"$OUT/grad_dtype_mlp_$grad.log" 2>&1
    tail -2 "$OUT/grad_dtype_mlp_$grad.log"
  done
  end_step
  echo "total: $(($(date +%s) - t_start)) s" >>"$OUT/gpu_times.txt"
  cat "$OUT/gpu_times.txt"
  [ ${#failed[@]} -eq 0 ] || { printf 'FAILED: %s\n' "${failed[@]}"; exit 1; }
  echo "ci/gpu.sh scaling-precision: done"
  exit 0
fi

step "CUDA-aware MPI prefix"
CUDA_MPI="${XPNN_CUDA_MPI_PREFIX:-$PWD/.cuda-mpi}"
if [ -f "$CUDA_MPI/env.sh" ]; then
  # Its mpirun, libmpi and mpi4py go first; the wheels' MPICH stays for nothing here.
  unset MPI4PY_LIBMPI
  # shellcheck disable=SC1091
  PYTHON="$PY" . "$CUDA_MPI/env.sh"
  export XPNN_CUDA_MPI_PREFIX="$CUDA_MPI" XPNN_TEST_MPIEXEC="$CUDA_MPI/bin/mpiexec"
  echo "using $CUDA_MPI: $(command -v mpiexec)"
  ompi_info --parsable --all | grep -q "mpi_built_with_cuda_support:value:true" \
    || fail "$CUDA_MPI: ompi_info does not report mpi_built_with_cuda_support:value:true"
  HAVE_CUDA_MPI=1
else
  fail "no CUDA-aware MPI at $CUDA_MPI: build it with 'bash ci/build-cuda-mpi.sh' and carry .cuda-mpi"
  HAVE_CUDA_MPI=0
fi
MPIEXEC="$(command -v mpiexec || true)"
[ -n "$MPIEXEC" ] || fail "no mpiexec on this machine"
if [ "$HAVE_CUDA_MPI" = 1 ] && [ -n "$MPIEXEC" ]; then
  # Open MPI copies large host messages between ranks with process_vm_readv (CMA), which a
  # sandboxed kernel may refuse: then every large exchange would abort. Checked once here.
  big='import numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; b = np.ones(1 << 24)
c.Allreduce(MPI.IN_PLACE, b); assert b.min() == b.max() == c.size, b[:3]; print("ok", c.size)'
  if ! timeout 60 "$MPIEXEC" -n 2 "$PY" -c "$big" >"$OUT/preflight.log" 2>&1; then
    cat "$OUT/preflight.log"
    echo "2-rank 128 MiB host allreduce failed; again without CMA (single copy mechanism none)"
    export OMPI_MCA_btl_vader_single_copy_mechanism=none
    timeout 60 "$MPIEXEC" -n 2 "$PY" -c "$big" >"$OUT/preflight.log" 2>&1 \
      || fail "2-rank host allreduce fails under $CUDA_MPI: $(tail -3 "$OUT/preflight.log")"
  fi
  cat "$OUT/preflight.log"
fi

step "environment"
nvidia-smi -L || true
timeout 120 "$PY" -m xpnn info | tee "$OUT/info.txt" || fail "python -m xpnn info"
if [ "$HAVE_CUDA_MPI" = 1 ]; then
  grep -q "^  CUDA-aware: yes" "$OUT/info.txt" || fail "xpnn info does not say 'CUDA-aware: yes'"
fi
if [ "$HAVE_CUDA_MPI" = 1 ] && [ -n "$MPIEXEC" ]; then
  # One 2-rank allreduce of a 128 MiB device buffer straight through MPI. Two ranks on one GPU
  # talk through Open MPI's smcuda transport, whose CUDA IPC a sandboxed driver may refuse;
  # then again without IPC (device memory staged by Open MPI itself), saying so.
  dev='import cupy as cp; from mpi4py import MPI; c = MPI.COMM_WORLD; b = cp.ones(1 << 24)
cp.cuda.get_current_stream().synchronize(); c.Allreduce(MPI.IN_PLACE, b)
assert float(b.min()) == float(b.max()) == c.size, b[:3]; print("device allreduce ok", c.size)'
  if ! timeout -k 5 60 "$MPIEXEC" -n 2 "$PY" -c "$dev" >"$OUT/preflight_device.log" 2>&1; then
    cat "$OUT/preflight_device.log"
    echo "2-rank device allreduce failed; again without CUDA IPC (btl_smcuda_use_cuda_ipc 0)"
    export OMPI_MCA_btl_smcuda_use_cuda_ipc=0
    timeout -k 5 60 "$MPIEXEC" -n 2 "$PY" -c "$dev" >"$OUT/preflight_device.log" 2>&1 \
      || fail "2-rank device allreduce fails under $CUDA_MPI: $(tail -3 "$OUT/preflight_device.log")"
  fi
  cat "$OUT/preflight_device.log"
fi

# 2 ranks on one GPU, float64: mpi-cuda must be the live path and equal mpi-host.
EQ_RUN=(--backend cupy --dataset synthetic --synthetic-size 4000 --epochs 2 --batch-size 256
  --dtype float64 --no-progress)
same_params() {  # FILE_A FILE_B: equal within 1e-10 relative, or say where not
  "$PY" - "$1" "$2" <<'EOF'
import sys
import numpy as np
with np.load(sys.argv[1], allow_pickle=False) as a, np.load(sys.argv[2], allow_pickle=False) as b:
    assert sorted(a.files) == sorted(b.files), (a.files, b.files)
    worst = 0.0
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-10, atol=0, err_msg=k)
        worst = max(worst, float(np.max(np.abs(a[k] - b[k]) / np.maximum(np.abs(b[k]), 1e-300))))
print(f"{sys.argv[1]} == {sys.argv[2]}: {len(a.files)} arrays, worst relative difference {worst:.3g}")
EOF
}
lives() {  # LOG COMM: the run line names COMM and nothing fell back
  [ -f "$1" ] || { fail "$1: no log"; return; }
  grep -q "comm $2, " "$1" || fail "$1: the run line does not say comm $2"
  if grep -q "falling back" "$1"; then fail "$1: fell back: $(grep 'falling back' "$1")"; fi
}

if [ -n "$MPIEXEC" ]; then
  step "mpi-cuda vs mpi-host: 2 ranks on one GPU, float64"
  for comm in mpi-cuda mpi-host; do
    run "$MPIEXEC" -n 2 "$PY" -m xpnn "${EQ_RUN[@]}" --comm "$comm" \
      --save "$OUT/params_$comm.npz" --metrics "$OUT/train_$comm.jsonl" >"$OUT/train_$comm.log" 2>&1
    cat "$OUT/train_$comm.log"
    lives "$OUT/train_$comm.log" "$comm"
  done
  same_params "$OUT/params_mpi-cuda.npz" "$OUT/params_mpi-host.npz" \
    || fail "mpi-cuda parameters differ from mpi-host's"
fi

# Tensor and pipeline parallelism over mpi-cuda against 1 NumPy rank: in the tests below.
step "mpi-cuda GPU tests (collectives, data/tensor/pipeline = mpi-host / 1 NumPy rank), detection"
run "$PY" -m pytest -q -ra tests/gpu/test_gpu_cuda_mpi.py tests/parallel/comm/test_cuda_aware.py

if [ -n "$MPIEXEC" ]; then
  step "allreduce of device buffers, 4 B to 256 MiB (2 ranks: mpi-cuda, mpi-host; 1 rank: nccl)"
  AR=(--device --max-size 268435456 --iters 20)
  run env XPNN_MPIEXEC="$MPIEXEC" "$PY" -m bench allreduce "${AR[@]}" --ranks 2 \
    --device-comms mpi-cuda,mpi-host --out "$OUT/allreduce_gpu.jsonl"
  run env XPNN_MPIEXEC="$MPIEXEC" "$PY" -m bench allreduce "${AR[@]}" --ranks 1 \
    --device-comms nccl --out "$OUT/allreduce_gpu_1rank.jsonl"
  if [ "$HAVE_CUDA_MPI" = 1 ]; then
    "$PY" - "$OUT/allreduce_gpu.jsonl" <<'EOF' || fail "allreduce: no mpi-cuda device rows"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
kinds = sorted({r["config"]["comm"] for r in rows if r["config"]["buffers"] == "device"})
print("device rows:", kinds)
assert "mpi-cuda" in kinds and "mpi-host" in kinds, kinds
EOF
  fi
fi

step "throughput (cupy vs PyTorch CUDA)"
run "$PY" -m bench throughput --backends cupy --batches 128,512 --out "$OUT/throughput_gpu.jsonl"
run "$PY" -m bench throughput --model cnn --backends cupy --batches 128 \
  --out "$OUT/throughput_cnn_gpu.jsonl"

if [ -n "$MPIEXEC" ]; then
  # Where the CNN's step goes on the GPU: each phase timed with the device synchronised.
  step "step phases of the CNN on cupy; host staging of device buffers, phase by phase"
  run env XPNN_MPIEXEC="$MPIEXEC" "$PY" -m bench step_phases --ranks 1 --backend cupy \
    --model cnn --batch-size 128 --dataset synthetic --synthetic-size 12800 --epochs 2 \
    --out "$OUT/step_phases_cnn_gpu.jsonl"
  run env XPNN_MPIEXEC="$MPIEXEC" "$PY" -m bench staging --ranks 1,2 --out "$OUT/staging.jsonl"
fi

step "GPU tests"
run "$PY" -m pytest -q -ra tests/gpu tests/backends/test_backends.py tests/nn/test_layers.py \
  --ignore=tests/gpu/test_gpu_cuda_mpi.py --ignore=tests/gpu/test_gpu_graph.py  # graphs: its mode

if [ -n "$MPIEXEC" ]; then
  step "2-rank --backend cupy training runs"
  run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --dataset synthetic --synthetic-size 20000 \
    --epochs 3 --batch-size 512 --metrics "$OUT/gpu_train.jsonl" --no-progress
  for comm in mpi-host mpi-cuda nccl; do
    run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --comm "$comm" --dataset synthetic \
      --synthetic-size 4000 --epochs 1 --no-progress
  done
  for parallel in tensor pipeline; do
    run "$MPIEXEC" -n 2 "$PY" -m xpnn --backend cupy --comm mpi-cuda --parallel "$parallel" \
      --dataset synthetic --synthetic-size 20000 --epochs 2 --batch-size 512 --no-progress
  done
fi

step "matmul crossover"
run "$PY" -m bench crossover --out "$OUT/crossover.jsonl"

end_step
echo "total: $(($(date +%s) - t_start)) s" >>"$OUT/gpu_times.txt"
echo
cat "$OUT/gpu_times.txt"
if [ ${#skipped[@]} -gt 0 ]; then
  echo "ci/gpu.sh: ${#skipped[@]} command(s) skipped, past XPNN_GPU_BUDGET=$XPNN_GPU_BUDGET s:"
  printf '  %s\n' "${skipped[@]}"
fi
if [ ${#failed[@]} -eq 0 ]; then
  echo "ci/gpu.sh: all GPU checks passed"
  exit 0
fi
echo "ci/gpu.sh: ${#failed[@]} check(s) FAILED:"
printf '  %s\n' "${failed[@]}"
exit 1
