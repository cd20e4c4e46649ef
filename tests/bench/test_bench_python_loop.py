"""``python -m bench python_loop``: the README's Python loop and ``python -m xpnn`` on the
same step, alternated, each side's samples per second recorded."""

from conftest import run_bench

from bench.core import read_records


def test_both_routes_are_timed_on_the_same_step(tmp_path):
    out = tmp_path / "p.jsonl"
    proc = run_bench("python_loop", "--quick", "--backend", "numpy", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = read_records(out, "python_loop")
    assert [r["config"]["side"] for r in records] == ["python -m xpnn", "Python loop"]
    for r in records:
        assert r["config"]["backend"] == "numpy" and r["metrics"]["samples_per_s"]["median"] > 0
    assert "| Python loop |" in proc.stdout
