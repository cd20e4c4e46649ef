"""--grad-dtype: the data-parallel gradients sent between ranks in a narrower float. The 16-bit
conversions round as ml_dtypes and NumPy do; under real mpiexec 2 ranks compute the 1-rank run
to the wire dtype's rounding with half the bytes; float16 runs under the loss scale, whose
skipped steps recover; bad or inapplicable settings are one line."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT, assert_one_line_user_error, mpiexec_path, run_xpnn, train_and_load

from xpnn.parallel.comm.narrow import (
    GradWire,
    _sum_into,
    bfloat16_bits,
    bfloat16_values,
    from_bits,
    to_bits,
)
from xpnn.parallel.model.whole import whole_params
from xpnn.run import RunSpec, build_run
from xpnn.runtime.world import init_world

# 3 steps of plain SGD: the wire's rounding reaches the parameters as lr x gradient, unmixed
# with Adam's division by the gradients' own size. mpi-host: the gradients are sent.
SGD_STEPS = [
    "--dataset", "synthetic", "--synthetic-size", "180", "--epochs", "1", "--batch-size", "60",
    "--hidden", "32,16", "--threads", "1", "--no-progress", "--backend", "numpy",
    "--optimizer", "sgd", "--lr", "0.1",
]  # fmt: skip
HOST = ["--comm", "mpi-host"]
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}  # machine epsilons
# Each step's summed gradient is off by at most eps x (|g_a| + |g_b|): each rank's half rounded
# (eps/2 each) and their sum rounded once (eps/2). Summed over the steps that is eps x the
# parameters' movement where the halves and the steps pull one way, as three small steps from
# one start mostly do; 4 allows the halves to partly cancel. Measured: 0.2 to 0.52 x eps x
# movement for both dtypes. A missing unscale (off by 2**15) or a lost bucket fails it; the
# wrong 16-bit format fails test_float16_rounds_less_than_bfloat16.
MOVEMENT_EPS = 4.0


# NumPy takes ml_dtypes' bfloat16; CuPy has none and gets the bits by integer arithmetic,
# run here on NumPy arrays
BF16_PATHS = {
    "ml_dtypes": (
        lambda xp, values: to_bits(xp, values, "bfloat16"),
        lambda xp, bits, wide: from_bits(xp, bits, "bfloat16", wide),
    ),
    "integers": (bfloat16_bits, bfloat16_values),
}


@pytest.mark.parametrize("path", BF16_PATHS)
def test_bfloat16_bits_round_as_ml_dtypes_does(path):
    to, back = BF16_PATHS[path]
    rng = np.random.default_rng(0)
    values = rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-44, 39, 20000)
    special = [np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-42, 0.0, -0.0, 1.0 + 2**-8]
    values = np.concatenate([values.astype(np.float32), np.array(special, np.float32)])
    bits = to(np, values)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    wide = back(np, bits, np.float32)
    np.testing.assert_array_equal(wide, values.astype(ml_dtypes.bfloat16).astype(np.float32))
    nan = to(np, np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(back(np, nan, np.float32)).all()  # not rounded to infinity


def test_float16_bits_are_numpys_float16():
    values = np.array([1e-8, 6.1e-5, 1.0, 65504.0, 7e4, -3.0], np.float32)
    with np.errstate(over="ignore"):  # 7e4 is past float16's largest, 65504: infinity
        bits = to_bits(np, values, "float16")
        np.testing.assert_array_equal(bits.view(np.float16), values.astype(np.float16))
    assert from_bits(np, bits, "float16", np.float64).dtype == np.float64


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_mpi_sum_is_the_16_bit_sum_in_place(dtype):
    """The reduction MPI calls adds into its second buffer as ml_dtypes' bfloat16 and NumPy's
    float16 add (exactly, in float32, then rounded once)."""
    native = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(5000).astype(native) for _ in range(2))
    into = b.view(np.uint16).copy()
    _sum_into(dtype, a.view(np.uint16), into)
    np.testing.assert_array_equal(into.view(native), a + b)


def test_float16_gradients_are_sent_times_the_loss_scale():
    """1e-8 is below float16's smallest subnormal (6e-8): sent as is it would arrive as 0."""
    grads = np.array([1e-8, -3e-7, 0.25], np.float32)
    wire = GradWire("float16", np, scale=lambda: 2.0**15)
    buf, factor = wire.pack(grads)
    assert buf.nbytes == 6 and factor == 2.0**15
    out = np.zeros_like(grads)
    wire.unpack(buf, factor, out)
    np.testing.assert_allclose(out, grads, rtol=EPS["float16"])
    unscaled = GradWire("float16", np)
    buf, factor = unscaled.pack(grads)
    unscaled.unpack(buf, factor, out)
    assert out[0] == 0  # what the scale is for


def _silent(line: str) -> None:
    pass


def _spec(args: list[str]) -> RunSpec:
    """A RunSpec from the flags ``args`` (the command line's own parser)."""
    from xpnn.commands.flags import build_parser, to_spec

    return to_spec(build_parser().parse_args(args))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The 1-rank run, in this process: its initial and final parameters."""
    trainer = build_run(_spec(SGD_STEPS), init_world(), log=_silent)
    start = {k: np.array(v) for k, v in whole_params(trainer.model, trainer.model_comm).items()}
    trainer.run()
    final = {k: np.array(v) for k, v in whole_params(trainer.model, trainer.model_comm).items()}
    return start, final


def _close_to_one_rank(one_rank, params, dtype):
    """The largest error as a multiple of eps x the parameters' movement, for each array."""
    start, final = one_rank
    ratios = {}
    for name, value in params.items():
        moved = np.abs(final[name] - start[name]).max()
        assert moved > 0, name  # the run moved it: closeness is not the trivial kind
        ratios[name] = np.abs(value - final[name]).max() / (EPS[dtype] * moved)
        assert ratios[name] <= MOVEMENT_EPS, (name, ratios[name])
    return max(ratios.values())


@pytest.fixture(scope="module")
def two_ranks_fp32(tmp_path_factory):
    return train_and_load(tmp_path_factory.mktemp("fp32"), 2, [*SGD_STEPS, *HOST])


def test_float32_on_float32_parameters_is_the_run_without_the_flag(tmp_path, two_ranks_fp32):
    _, records, _ = two_ranks_fp32
    _, same, _ = train_and_load(tmp_path, 2, [*SGD_STEPS, *HOST, "--grad-dtype", "float32"])
    assert same[-1]["params_sha256"] == records[-1]["params_sha256"]
    assert same[0]["comm_bytes"] == records[0]["comm_bytes"] > 0
    assert same[-1]["grad_dtype"] == "float32" and "grad_dtype" not in records[-1]


def test_float32_on_float64_parameters_halves_the_bytes(tmp_path):
    """float64 parameters, float32 on the wire: the 1-rank float64 run to float32's rounding."""
    wide = [*SGD_STEPS, "--dtype", "float64", *HOST]
    one, _, _ = train_and_load(tmp_path, 1, wide[:-2])
    two64, records64, _ = train_and_load(tmp_path, 2, wide)
    two32, records32, _ = train_and_load(tmp_path, 2, [*wide, "--grad-dtype", "float32"])
    assert records32[0]["comm_bytes"] * 2 == records64[0]["comm_bytes"]
    for name in one:  # float64 throughout: 2 ranks are the 1-rank run to float64's round-off
        np.testing.assert_allclose(two64[name], one[name], rtol=1e-12, atol=1e-15)
        error = np.abs(two32[name] - one[name]).max()
        assert 0 < error <= 1e-5, (name, error)  # float32's eps (1.2e-7) x lr x gradients
        assert two32[name].dtype == np.float64


@pytest.fixture(scope="module")
def narrow_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("narrow")
    return {
        dtype: train_and_load(tmp, 2, [*SGD_STEPS, *HOST, "--grad-dtype", dtype])
        for dtype in ("bfloat16", "float16")
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_ranks_in_a_16_bit_exchange_compute_the_one_rank_run(
    one_rank, two_ranks_fp32, narrow_runs, dtype
):
    params, records, _ = narrow_runs[dtype]
    _, records32, _ = two_ranks_fp32
    assert records[-1]["ranks_agree"] and records[-1]["update"] == "allreduce"
    assert records[0]["comm_bytes"] * 2 == records32[0]["comm_bytes"]  # 2 bytes a value, not 4
    assert records[-1]["grad_dtype"] == dtype
    _close_to_one_rank(one_rank, params, dtype)
    for name, value in params.items():
        assert value.dtype == np.float32, name  # the parameters stay float32


def test_float16_rounds_less_than_bfloat16(one_rank, narrow_runs):
    """float16 keeps 3 more fraction bits: its error is the smaller, or the wire did nothing."""
    errors = {
        dtype: max(np.abs(v - one_rank[1][k]).max() for k, v in run[0].items())
        for dtype, run in narrow_runs.items()
    }
    assert 0 < errors["float16"] < errors["bfloat16"]
    assert narrow_runs["float16"][1][-1]["skipped_steps"] == 0  # under a loss scale: said


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", "bfloat16"), ("fp16", "float16"), ("bf16", "float16")]
)
def test_a_narrow_exchange_with_low_precision_passes(tmp_path, precision, dtype):
    """Each with the 1-rank run in the same precision: the exchange adds its own rounding."""
    flags = [*SGD_STEPS, "--precision", precision]
    one, _, _ = train_and_load(tmp_path, 1, flags)
    two, records, _ = train_and_load(tmp_path, 2, [*flags, *HOST, "--grad-dtype", dtype])
    assert records[-1]["ranks_agree"] and records[-1]["skipped_steps"] == 0
    for name in one:  # within bf16's rounding of a step (lr 0.1 x gradients below 1)
        assert np.abs(two[name] - one[name]).max() <= 0.1 * 4 * EPS["bfloat16"], name


def test_across_nodes_of_shared_memory_the_node_sums_go_narrow(tmp_path, narrow_runs):
    """Two ranks as two nodes (XPNN_RANKS_PER_NODE=1): each node's sum crosses in bfloat16."""
    flags = [*SGD_STEPS, "--comm", "mpi-shm", "--grad-dtype", "bfloat16"]
    saved, metrics = tmp_path / "p.npz", tmp_path / "m.jsonl"
    env = {"XPNN_RANKS_PER_NODE": "1"}
    proc = run_xpnn([*flags, "--save", str(saved), "--metrics", str(metrics)], 2, env=env)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    host, host_records, _ = narrow_runs["bfloat16"]
    assert records[-1]["update"] == "shared gradients"
    assert records[0]["comm_bytes"] == host_records[0]["comm_bytes"]  # 2 bytes a value
    with np.load(saved) as shm:
        for name, value in host.items():  # the same two halves, summed and rounded once
            np.testing.assert_array_equal(shm[name], value, err_msg=name)


OVERFLOW = """
import sys
from xpnn.commands.flags import build_parser, to_spec
from xpnn.run import build_run
from xpnn.runtime.world import init_world
spec = to_spec(build_parser().parse_args(sys.argv[1:]))
trainer = build_run(spec, init_world(), log=lambda line: None)
trainer.loss_scale.scale = 2.0**30  # scaled gradients above 6e-5 overflow float16
done = trainer.run()
if trainer.comm.rank == 0:
    print(done["skipped_steps"], trainer.optimizer.step_count, trainer.loss_scale.scale)
"""


def test_an_overflowing_float16_exchange_skips_steps_and_recovers():
    """fp32 passes, float16 on the wire: the sums overflow, every rank skips those steps and
    halves the scale until they fit, then trains on; no step is lost."""
    flags = [*SGD_STEPS, *HOST, "--grad-dtype", "float16", "--epochs", "10"]
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, "-c", OVERFLOW, *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    skipped, steps, scale = proc.stdout.split()
    # 14 skipped in the measured run, 2**30 halved to 2**16
    assert 1 <= int(skipped) < 30 and int(steps) + int(skipped) == 30  # 10 epochs x 3
    assert float(scale) == 2.0 ** (30 - int(skipped))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grad-dtype", "fp16"], "--grad-dtype: invalid choice: 'fp16'"),
        (["--grad-dtype", "bfloat16", "--parallel", "tensor"], "--grad-dtype bfloat16: only with"),
        (["--grad-dtype", "float16", "--parallel", "pipeline"], "--grad-dtype float16: only with"),
    ],
)
def test_bad_grad_dtypes_are_one_line(flags, message):
    assert_one_line_user_error(run_xpnn([*SGD_STEPS, *flags]), message)


def test_shared_memory_on_one_node_sends_no_gradients_and_says_so(tmp_path):
    flags = [*SGD_STEPS, "--comm", "mpi-shm", "--grad-dtype", "bfloat16"]
    _, records, proc = train_and_load(tmp_path, 2, flags)
    assert "note: --grad-dtype has no effect with comm mpi-shm" in proc.stderr
    assert records[0]["comm_bytes"] == 0


def test_torch_tensors_are_sent_narrow_alike(tmp_path, one_rank, narrow_runs):
    """PyTorch has its own bfloat16: the same bits, the same bytes (CPU tensors, 2 ranks)."""
    torch_flags = [*SGD_STEPS, *HOST, "--backend", "torch", "--device", "cpu"]
    params, records, _ = train_and_load(tmp_path, 2, [*torch_flags, "--grad-dtype", "bfloat16"])
    assert records[0]["comm_bytes"] == narrow_runs["bfloat16"][1][0]["comm_bytes"]
    _close_to_one_rank(one_rank, params, "bfloat16")
