"""``python bench/attention_kernels.py --sides OLD_ROOT,NEW_ROOT [--rounds 3] [--calls 41]``:
the Numba backend's causal attention, forward and backward, of two checkouts side by side.

Each round runs one worker process per side, in turn (old, new, old, new, ...), with that
side's checkout first on ``sys.path`` and one BLAS and Numba thread; a worker times
``NumbaKernels.causal_attention`` and its backward at the GPT's shape (32 sequences, 4 heads,
64 positions, head size 32, float32; queries, keys and values the strided views the layer
hands over) and the batched products alone (``np.matmul`` of the whole (T, T) matrices into
preallocated outputs), each by the process's CPU time (``time.process_time``: on a loaded
machine a 1-thread call's CPU time is what it costs), after untimed calls. A worker's sample is
the median of its calls; the table gives each side's medians over the rounds and their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPE = (32, 4, 64, 32)  # (sequences, heads, positions, head size): docs/gpt.md's model


def _views(rng, b: int, h: int, t: int, d: int):  # noqa: ANN001, ANN202
    """Queries, keys and values as ``CausalSelfAttention`` hands them over, and dL/dout."""
    import numpy as np

    qkv = rng.standard_normal((b, t, h, 3, d)).astype(np.float32)
    q, k, v = (qkv[:, :, :, i, :].transpose(0, 2, 1, 3) for i in range(3))
    merged = np.empty((b, t, h * d), dtype=np.float32)
    out = merged.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    dout = rng.standard_normal((b, t, h * d)).astype(np.float32)
    dout = dout.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    dqkv = np.empty((b, t, h, 3, d), dtype=np.float32)
    grads = tuple(dqkv[:, :, :, i, :].transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v, out, dout, grads


def _time(fn, calls: int, warm: int) -> float:  # noqa: ANN001
    for _ in range(warm):
        fn()
    took = []
    for _ in range(calls):
        start = time.process_time()
        fn()
        took.append(time.process_time() - start)
    return statistics.median(took) * 1e3


def worker(calls: int, warm: int) -> dict[str, float]:
    """One side's medians (ms) in this process."""
    import numpy as np

    from xpnn.backends import get_backend

    kernels = get_backend("numba", "float32").kernels
    b, h, t, d = SHAPE
    q, k, v, out, dout, grads = _views(np.random.default_rng(0), b, h, t, d)
    scale = 1 / d**0.5
    _, p = kernels.causal_attention(q, k, v, scale, out=out)
    s, ds = np.empty_like(p), np.empty_like(p)
    dq, dk, dv = grads

    def products_forward() -> None:
        np.matmul(q, k.swapaxes(-1, -2), out=s)
        np.matmul(p, v, out=out)

    def products_backward() -> None:
        np.matmul(p.swapaxes(-1, -2), dout, out=dv)
        np.matmul(dout, v.swapaxes(-1, -2), out=ds)
        np.matmul(ds, k, out=dq)
        np.matmul(ds.swapaxes(-1, -2), q, out=dk)

    return {
        "forward": _time(lambda: kernels.causal_attention(q, k, v, scale, out=out), calls, warm),
        "backward": _time(
            lambda: kernels.causal_attention_backward(dout, q, k, v, p, scale, out=grads),
            calls,
            warm,
        ),
        "products forward": _time(products_forward, calls, warm),
        "products backward": _time(products_backward, calls, warm),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", required=True, help="checkout roots, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=41)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.calls, args.warm)))
        return 0
    roots = args.sides.split(",")
    one = {n: "1" for n in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")}
    samples: dict[str, list[dict[str, float]]] = {root: [] for root in roots}
    for _ in range(args.rounds):
        for root in roots:
            env = {**os.environ, **one, "PYTHONPATH": root}
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--sides", root]
            cmd += ["--calls", str(args.calls), "--warm", str(args.warm)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            samples[root].append(json.loads(done.stdout.strip().splitlines()[-1]))
    with open("/proc/loadavg", encoding="ascii") as f:
        load = f.read().split()[:3]
    print(f"{args.rounds} rounds of {args.calls} calls a side; load average now {' '.join(load)}")
    print("| side | " + " | ".join(samples[roots[0]][0]) + " |")
    for root, runs in samples.items():
        cells = []
        for name in runs[0]:
            values = [r[name] for r in runs]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})")
        print(f"| {root} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
