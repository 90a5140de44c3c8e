"""benchmarks/guard_compare.py: the speed guard gates graph-replay rows only, on medians of the rounds."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "guard_compare.py")
ENV = {"torch": "x", "gpu": "test"}


def write_runs(tmp_path, new_factor: dict, rounds=3):
    """Base rows at fixed times; new rows = base x ``new_factor[(name, impl, metric)]`` (default 1)."""
    base = [("layer_dsa_attention", "triton+graph", {"median_us": 480.0}),
            ("layer_dsa_attention", "triton", {"median_us": 460.0}),
            ("engine_decode", "dsa+graph", {"median_us": 3000.0, "replay_us": 2800.0})]
    for side in ("base", "new"):
        for r in range(1, rounds + 1):
            folder = tmp_path / side / f"r{r}"
            folder.mkdir(parents=True)
            rows = []
            for name, impl, values in base:
                scaled = {m: v * (new_factor.get((name, impl, m), 1.0) if side == "new" else 1.0) * (1 + 0.001 * r)
                          for m, v in values.items()}
                rows.append({"name": name, "impl": impl, "shape": {"B": 64, "S": 8191}, **scaled})
            (folder / "bench.json").write_text(json.dumps({"env": ENV, "rows": rows}))


def run(tmp_path):
    out = tmp_path / "guard.json"
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--json", str(out)], capture_output=True, text=True)
    return done, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.parametrize("factor, passed", [
    ({}, True),
    ({("layer_dsa_attention", "triton", "median_us"): 1.5, ("engine_decode", "dsa+graph", "median_us"): 1.2}, True),
    ({("layer_dsa_attention", "triton+graph", "median_us"): 1.04}, False),
    ({("engine_decode", "dsa+graph", "replay_us"): 1.031}, False),
    ({("engine_decode", "dsa+graph", "replay_us"): 1.029}, True),
], ids=["same", "eager-and-wall-not-gated", "layer-replay-4pct", "engine-replay-3.1pct", "engine-replay-2.9pct"])
def test_only_graph_replay_rows_are_gated(tmp_path, factor, passed):
    write_runs(tmp_path, factor)
    done, result = run(tmp_path)
    assert done.returncode == (0 if passed else 1), done.stdout + done.stderr
    assert result["passed"] is passed and result["rounds"] == 3
    gated = {(r["name"], r["impl"], r["metric"]) for r in result["rows"] if r["gated"]}
    assert gated == {("layer_dsa_attention", "triton+graph", "median_us"), ("engine_decode", "dsa+graph", "replay_us")}


def test_unequal_rounds_are_refused(tmp_path):
    write_runs(tmp_path, {})
    (tmp_path / "new" / "r3" / "bench.json").unlink()
    (tmp_path / "new" / "r3").rmdir()
    done, _ = run(tmp_path)
    assert done.returncode != 0 and "expected as many base as new rounds" in done.stderr
