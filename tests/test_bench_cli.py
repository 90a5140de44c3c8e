"""The CLI and the benchmark plumbing that runs without a GPU: render, refusals, result rows."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from dsa.bench.harness import gpu_slug, result_row, write_result
from dsa.bench.report import BEGIN, END, format_rows, load_results, render_markdown, update_readme
from dsa.cli import main

FIXTURE = "tests/data/ceilings-fixture.json"


def test_render_fixture_into_readme(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "indexer-h200-2026-11-29.json")
    docs = load_results(str(tmp_path))
    md = render_markdown(docs)
    assert "| `indexer-h200-2026-11-29.json` | NVIDIA H200 | 4.28 | 692 | 1272 |" in md
    assert "| indexer_logits_paged | triton | B=64 N=1 S=65536 | 150.0 | 3.69 |  | 86% copy | <= 145 us (missed) |" in md
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\nold\n{END}\ntail\n")
    update_readme(str(readme), md)
    text = readme.read_text()
    assert "old" not in text and md in text and text.endswith(f"{END}\ntail\n")


def test_render_script_runs(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/render.py"], capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_empty_results_render():
    assert "No benchmark results" in render_markdown([])


def test_result_row_and_file(tmp_path):
    ceilings = {"copy_tbps": 4.0, "bf16_tflops": 500.0, "fp8_tflops": 1000.0}
    row = result_row("op", "triton", {"B": 1}, {"median_us": 100.0}, ceilings, bytes_moved=2e8, flops=5e10,
                     bound="bf16", target_us=90)
    assert row["tbps"] == pytest.approx(2.0) and row["tflops"] == pytest.approx(500.0)
    assert row["frac_ceiling"] == pytest.approx(1.0) and row["target_us"] == 90
    path = write_result("op", [row], ceilings, {"gpu": "NVIDIA H200", "date": "2026-11-29"}, str(tmp_path))
    assert path.endswith("op-h200-2026-11-29.json")
    assert json.load(open(path))["rows"][0]["name"] == "op"
    assert "op" in format_rows([row])
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb"


def test_plot_from_fixture(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "indexer-h200-2026-11-29.json")
    doc = json.loads((tmp_path / "indexer-h200-2026-11-29.json").read_text())
    row = dict(doc["rows"][0], median_us=300.0, bytes=2 * doc["rows"][0]["bytes"])
    row["shape"] = dict(row["shape"], S=131072)
    doc["rows"].append(row)
    (tmp_path / "indexer-h200-2026-11-29.json").write_text(json.dumps(doc))
    assert main(["bench", "plot", "--results", str(tmp_path), "--figures", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "time_vs_context.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("op", ["ceilings", "indexer", "topk", "mla", "layer", "crossover", "engine", "prefix"])
def test_timing_refuses_without_cuda(op):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", op])


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "dsa", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "bench" in out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer", "crossover"])
def test_layer_and_crossover_benchmarks_run(op, tmp_path):
    assert main(["bench", op, "--quick", "--reps", "3", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.startswith(op) for f in files)
    if op == "crossover":
        thresholds = json.loads(next(tmp_path.glob("dispatch_*.json")).read_text())
        assert "prefill_mha_min_query" in thresholds
