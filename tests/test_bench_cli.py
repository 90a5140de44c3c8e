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
from dsa.errors import DSAError

FIXTURE = "tests/data/ceilings-fixture.json"


def test_render_fixture_into_readme(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "indexer-h200-2026-11-29.json")
    docs = load_results(str(tmp_path))
    md = render_markdown(docs)
    assert "| `indexer-h200-2026-11-29.json` | NVIDIA H200 | 4.28 | 692 | 1272 |" in md
    assert "| indexer_logits_paged | triton | B=64 N=1 S=65536 | 150.0 |  | 3.69 |  | 86% copy | <= 145 us (missed) |" in md
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


@pytest.mark.parametrize("argv, message", [
    (["bench", "engine", "--tp", "0"], "dsa bench engine: --tp must be a positive number, got 0"),
    (["bench", "mla", "--tp", "2"], "dsa bench mla: --tp applies to `dsa bench engine` only"),
    (["bench", "engine", "--tp", "2"], "--tp 2 needs one process per rank: `torchrun --nproc-per-node 2 -m dsa bench "
                                       "engine --tp 2`"),
    (["bench", "allreduce"], "dsa bench allreduce: needs 2 or more ranks"),
    (["bench", "engine", "--speculative-tokens", "2", "--spec-batch", "1,0"], "dsa bench engine: --spec-batch: "
                                                                             "expected batch sizes >= 1"),
    (["bench", "engine", "--spec-batch", "4"], "dsa bench engine: --spec-batch: expected batch sizes >= 1, "
                                               "comma-separated, with --speculative-tokens; got '4'"),
])
def test_tensor_parallel_benches_refuse_bad_ranks(argv, message, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, world, message", [
    (["bench", "engine", "--tp", "2"], "4", "dsa bench engine: --tp 2 but torchrun started 4 ranks"),
    (["bench", "mla"], "2", "dsa bench mla: runs in one process, but torchrun started 2 ranks"),
    (["bench", "allreduce"], "1", "dsa bench allreduce: needs 2 or more ranks"),
])
def test_rank_counts_under_torchrun_are_checked(argv, world, message, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_result_files_carry_the_command_line(monkeypatch):
    from argparse import Namespace

    from dsa.commands.bench import command_line
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = Namespace(argv=["bench", "engine", "--out", "a b"])
    assert command_line(args) == "python -m dsa bench engine --out 'a b'"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = Namespace(argv=["bench", "engine", "--tp", "2"])
    assert command_line(args) == "torchrun --nproc-per-node 2 -m dsa bench engine --tp 2"


def _engine_doc(tmp_path, tp: int, replay: float, bare: float | None, date: str) -> None:
    ceilings = {"copy_tbps": 4.0, "bf16_tflops": 500.0, "fp8_tflops": 1000.0}
    extra = {} if bare is None else {"replay_no_allreduce_us": bare}
    decode = result_row("engine_decode", "dsa+graph", {"B": 1, "S": 32768, "layers": 4}, {"median_us": replay + 100},
                        ceilings, replay_us=replay, tp_size=tp, allreduce=None if tp == 1 else "symm_mem", **extra)
    prefill = result_row("engine_prefill", "dsa", {"S": 32768, "chunk": 8192, "layers": 4},
                         {"median_us": 4e5 if tp == 1 else 2.5e5},
                         ceilings, tp_size=tp, **({} if bare is None else {"no_allreduce_us": 2.3e5}))
    write_result("engine" if tp == 1 else f"engine-tp{tp}", [decode, prefill], ceilings,
                 {"gpu": "NVIDIA H200", "date": date, "time_utc": date}, str(tmp_path))


def test_tp_compare_puts_the_runs_side_by_side(tmp_path):
    from dsa.bench.report import tp_compare
    _engine_doc(tmp_path, 1, 2000.0, None, "2026-12-01")
    _engine_doc(tmp_path, 1, 9999.0, None, "2026-11-01")  # older: not used
    _engine_doc(tmp_path, 2, 1250.0, 1000.0, "2026-12-02")
    text = tp_compare(load_results(str(tmp_path)))
    assert ("TP=2 `engine-tp2-h200-2026-12-02.json` (all-reduce: symm_mem) against TP=1 "
            "`engine-h200-2026-12-01.json`") in text
    assert "| TP=1 us | TP=2 us | speedup |" in text
    # decode: wall 2100 vs 1350 us; replay 2000 vs 1250, 1000 without all-reduce: 20% all-reduce;
    # replicated (2 * 1000 - 2000) / 1 = 0 us of 2000
    row = "| engine_decode | dsa+graph | B=1 S=32768 layers=4 | 2100 | 1350 | 1.56 | 2000 | 1250 | 1000 | 20.0 | 0 |"
    assert row in text
    # prefill: 400 vs 250 ms, 230 without all-reduce: 8%; replicated (2 * 230 - 400) / 400 = 15%
    row = "| engine_prefill | dsa | S=32768 chunk=8192 layers=4 | 400000 | 250000 | 1.60 |  |  | 230000 | 8.0 | 15 |"
    assert row in text
    assert main(["bench", "render", "--tp-compare", "--results", str(tmp_path)]) == 0


def test_tp_compare_without_tp_results_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no engine-tpN result file in"):
        main(["bench", "render", "--tp-compare", "--results", str(tmp_path)])


@pytest.mark.parametrize("gaps, median", [
    ([100.0], 100.0),
    ([100.0, 300.0, 200.0], 200.0),
    ([100.0] * 6 + [5000.0], 100.0),  # one slow step moves the mean, not the median
    ([400.0, 100.0, 300.0, 200.0], 300.0),  # even count: the upper median, as Timer
], ids=["one", "three", "a-slow-step", "even"])
def test_engine_step_timing_reports_the_median_and_the_mean_apart(gaps, median):
    from dsa.bench.engine import step_timing
    t0, returned = 10.0, []
    for g in gaps:
        returned.append((returned[-1] if returned else t0) + g * 1e-6)
    end = returned[-1] + 50e-6  # the closing synchronize waits for the last step's device work
    t = step_timing(t0, returned, end)
    mean = (sum(gaps) + 50.0) / len(gaps)
    assert t["median_us"] == pytest.approx(median) and t["mean_us"] == pytest.approx(mean), \
        f"gaps {gaps}: median {t['median_us']} (want {median}), mean {t['mean_us']} (want {mean})"
    assert t["reps"] == len(gaps) and t["p10_us"] <= t["median_us"] <= t["p90_us"], t


def test_engine_bench_finds_the_graph_its_last_step_replayed(monkeypatch):
    """``bench engine`` times the graph of its timed window's last step: the key it asks for is one the
    runner captured (CUDA graphs emulated on the CPU: ``record`` runs the step, a replay reruns it)."""
    from types import SimpleNamespace

    from dsa import DSAConfig, DSAModel
    from dsa.bench.engine import STEPS, WARMUP, decoding_engine, last_step_bucket
    model = DSAModel.random(DSAConfig.tiny(n_routed_experts=None, block_size=64), dtype=torch.float32)
    b, s = 3, 300  # the bench's random index cache rows are 64-token blocks
    engine = decoding_engine(model, b, s, torch.Generator().manual_seed(0), cuda_graphs=None)

    def record(step):
        outputs = step()
        return SimpleNamespace(replay=lambda: [o.copy_(r) for o, r in zip(outputs, step()) if o is not None]), outputs

    monkeypatch.setattr(engine.runner, "use_graphs", True)
    monkeypatch.setattr(engine.runner, "record", record)
    for _ in range(WARMUP + STEPS):
        engine.step()
    assert engine.stats.graph_steps == WARMUP + STEPS
    key = last_step_bucket(b, s, model.config.block_size)
    assert key in engine.runner.graphs, f"bench engine asks for {key}; the runner captured {list(engine.runner.graphs)}"


def test_render_into_a_readme_without_markers_is_one_line(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "indexer-h200-2026-11-29.json")
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit) as e:
        main(["bench", "render", "--results", str(tmp_path), "--readme", str(readme)])
    assert str(e.value.code) == f"{readme}: no {BEGIN} ... {END} markers to render between", e.value.code
    assert readme.read_text() == "# no markers\n"


@pytest.mark.parametrize("error, exits", [(DSAError, True), (ValueError, False), (RuntimeError, False)],
                         ids=["dsa-error", "value-error", "runtime-error"])
def test_dispatch_turns_only_a_dsa_error_into_the_exit(error, exits):
    from argparse import Namespace

    from dsa.commands import dispatch

    def func(args):
        raise error("dsa bench x: one line")
    if exits:
        with pytest.raises(SystemExit) as e:
            dispatch(Namespace(func=func))
        assert e.value.code == "dsa bench x: one line" and e.value.__cause__ is None, e.value
    else:
        with pytest.raises(error, match="one line"):  # a bug keeps its traceback
            dispatch(Namespace(func=func))
    assert dispatch(Namespace(func=lambda args: 3)) == 3
