"""``max_model_len`` (issue #38): through Engine, dsa.LLM and the commands; a random model's limit
raised (one warning past the RoPE's trained range), a checkpoint's refused in one line naming it;
the decode graphs' context buckets up to 1M; a long prefill's cost by position and its progress on
the server's stats line; ``dsa bench long`` at tiny lengths."""
import json
import logging

import pytest
import torch

from dsa import Engine, SamplingParams
from dsa.cli import main
from dsa.engine.runner import decode_graph_estimate
from dsa.kernels.common import cdiv
from dsa.model.presets import PRESETS, default_model
from dsa.model.route import context_bucket, context_buckets
from dsa.serve.engine_loop import EngineLoop, prefill_progress
from model_utils import prompt, tiny_model

WARNED = "past the RoPE's trained range"


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "max_model_len" in r.getMessage()]


def test_a_random_model_is_raised_with_one_warning_past_the_trained_range(caplog):
    model = tiny_model()  # DSAConfig.tiny: max_position_embeddings 16384, V3.2's YaRN (40 x 4096 = 163840)
    assert model.trained_positions == 163840
    with caplog.at_level(logging.WARNING, logger="dsa.model"):
        engine = Engine(model, num_blocks=8, max_model_len=100000)  # within the trained range: no warning
        assert _warnings(caplog) == []
        assert engine.max_model_len == engine.config.max_position_embeddings == model.config.max_position_embeddings
        assert model.config.max_position_embeddings == 100000 and model.rope_tables()[0].shape[0] == 100000
        engine = Engine(model, num_blocks=8, max_model_len=1 << 20)
    (line,) = _warnings(caplog)
    assert line.startswith("max_model_len: 1048576 tokens is past the RoPE's trained range of 163840 positions "
                           "(YaRN factor 40 x original_max_position_embeddings 4096)") and "\n" not in line
    assert model.rope_tables()[0].shape[0] == 1 << 20 and engine.runner.batch.block_table.shape[1] == (1 << 20) // 16
    out = engine.generate([prompt(20, 1)], 3)  # the raised model still runs, and gives the tokens it gave before
    assert out == Engine(tiny_model(), num_blocks=8).generate([prompt(20, 1)], 3)


def test_a_smaller_max_model_len_limits_requests_and_leaves_the_config():
    model = tiny_model()
    engine = Engine(model, num_blocks=8, max_model_len=40)
    assert model.config.max_position_embeddings == 16384 and engine.max_model_len == 40
    with pytest.raises(ValueError) as e:
        engine.add_request(prompt(38, 1), 3)
    assert str(e.value) == "prompt_ids: 38 + max_new_tokens 3 = 41 tokens exceed max_model_len 40"
    assert len(engine.generate([prompt(37, 1)], 3)[0]) == 3
    assert engine.runner.batch.token_ids.shape[1] == 40


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "1024"])
def test_a_bad_max_model_len_is_one_line_naming_it(value):
    with pytest.raises((ValueError, TypeError), match=r"^max_model_len: ") as e:
        Engine(tiny_model(), num_blocks=8, max_model_len=value)
    assert "\n" not in str(e.value)


def test_a_checkpoint_refuses_past_its_limit_in_one_line():
    model = default_model("cpu")  # the embedded default: a checkpoint of 16K positions
    with pytest.raises(ValueError) as e:
        Engine(model, num_blocks=8, max_model_len=16385)
    message = str(e.value)
    assert message.startswith("max_model_len: 16385 tokens is more than this checkpoint allows, "
                              "max_position_embeddings 16384 in ") and message.endswith("; give at most 16384")
    assert "config.json" in message and "\n" not in message and model.config.max_position_embeddings == 16384
    assert Engine(model, num_blocks=8, max_model_len=16384).max_model_len == 16384  # up to it is fine
    import dsa
    with pytest.raises(ValueError, match=r"^max_model_len: 20000 tokens is more than this checkpoint allows"):
        dsa.LLM(max_model_len=20000, num_blocks=8)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"], ["demo"], ["serve"]])
def test_the_commands_refuse_past_a_checkpoints_limit_in_one_line(argv, monkeypatch):
    import dsa.commands.serve
    monkeypatch.setattr(dsa.commands.serve, "serve_until_stopped", lambda *a: pytest.fail("served"))
    with pytest.raises(SystemExit) as e:
        main(argv + ["--device", "cpu", "--max-model-len", "20000"])
    message = str(e.value.code)
    assert message.startswith(f"dsa {argv[0]}: --max-model-len: 20000 tokens is more than this checkpoint allows, "
                              "max_position_embeddings 16384 in "), message
    assert "\n" not in message


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"], ["demo"], ["bench", "long"]])
def test_the_commands_refuse_a_max_model_len_below_one(argv):
    with pytest.raises(SystemExit, match=r"--max-model-len must be at least 1, got 0$"):
        main(argv + ["--device", "cpu", "--max-model-len", "0"])


def test_generate_on_a_preset_past_its_range_warns_once(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="dsa.model"):
        assert main(["generate", "--preset", "tiny", "--device", "cpu", "--num-blocks", "8", "--max-model-len",
                     "300000", "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert len(_warnings(caplog)) == 1 and WARNED in _warnings(caplog)[0]


def test_the_server_refuses_a_request_past_max_model_len_with_400():
    from dsa.serve.openai_server import APIError, _Server

    class _LLM:
        engine = Engine(tiny_model(), num_blocks=64, max_model_len=100)

    server = _Server(_LLM(), None, "m")
    with pytest.raises(APIError) as e:
        server.check_fits(list(range(90)), 20)
    assert e.value.status == 400 and e.value.message == ("prompt (90 tokens) + max_tokens (20) = 110 tokens exceed "
                                                         "the limit of 100 tokens (max_model_len)")
    server.check_fits(list(range(90)), 10)


def test_bench_serve_passes_max_model_len_to_the_server(monkeypatch):
    import argparse

    import dsa.bench.serve as bs

    seen = []

    def popen(cmd, **kw):
        seen.append(cmd)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bs.subprocess, "Popen", popen)
    args = argparse.Namespace(max_batch_tokens=8192, preset="demo-gpu", checkpoint=None, device=None, dtype=None,
                              num_blocks=None, max_model_len=1049600, ready_timeout=1.0)
    with pytest.raises(RuntimeError, match="stop here"):
        bs.StartedServer(args)
    cmd = seen[0]
    assert cmd[cmd.index("--max-model-len") + 1] == "1049600" and cmd[cmd.index("--preset") + 1] == "demo-gpu"


# ---- decode graph buckets up to 1M ----------------------------------------------------------------
def _old_bucket(s: int, p: int) -> int:
    b = 256 if s <= 256 else 1 << (s - 1).bit_length()
    return cdiv(cdiv(s, 4096) * 4096 if b > 4096 else b, p) * p


def test_context_buckets_cover_1m_with_few_graphs_and_little_padding():
    buckets = context_buckets(1 << 20, 64)
    assert buckets[-1] == 1 << 20 and len(buckets) == 84  # 5 up to 4K, 31 more to 128K, 16 per doubling after
    assert context_buckets((1 << 20) + 32, 64)[-1] == (1 << 20) + 65536  # a 1M prompt + its new tokens
    assert all(b % 64 == 0 for b in buckets) and buckets == sorted(set(buckets))
    assert len(context_buckets(163840, 64)) == 40  # V3.2's YaRN range: fewer than the 44 of steps of 4K
    g = torch.Generator().manual_seed(0)
    for s in torch.randint(65537, 1 << 22, (2000,), generator=g).tolist():
        b = context_bucket(s, 64)
        assert s <= b < s * (1 + 1 / 16), s
    for s in list(range(1, 9000)) + torch.randint(9000, 131073, (2000,), generator=g).tolist():
        assert context_bucket(s, 64) == _old_bucket(s, 64), s  # up to 128K the buckets are the ones before


def test_decode_graph_estimate_at_1m_from_the_shapes():
    config = PRESETS["demo-gpu"]().replace(max_position_embeddings=(1 << 20) + 64)
    one = decode_graph_estimate(config, (1 << 20) + 64, 1)
    assert one["context_buckets"] == one["graphs"] == 85 and one["largest_context_bucket"] == (1 << 20) + 65536
    assert one["paged_logits_bytes"] == ((1 << 20) + 65536) * 4
    full = decode_graph_estimate(config, 1 << 20, 128)
    assert full["graphs"] == 84 * 8 and full["paged_logits_bytes"] == 128 * (1 << 20) * 4  # 512 MiB, once
    assert full["logits_bytes"] == 84 * 255 * config.vocab_size * 4
    assert full["plan_bytes"] < 400 << 20


def test_warmup_enumerates_the_buckets_up_to_max_model_len_and_max_num_seqs():
    model = tiny_model()
    engine = Engine(model, num_blocks=80, max_batch_tokens=32, max_num_seqs=1, max_model_len=1200)
    report = engine.warmup(progress=False)
    assert engine.runner.context_buckets(1200) == [256, 512, 1024, 2048]
    assert report["decode_buckets"] == 4  # one row (max_num_seqs) at each bucket up to 1200 tokens (the pool's 1280)


def test_warmup_captures_the_largest_graphs_first(monkeypatch):
    """Each smaller graph reuses the memory a larger one freed in the shared pool (ascending, the pool held
    the sum of every bucket's paged logits: 26 GiB at 1M tokens on the H200)."""
    engine = Engine(tiny_model(), num_blocks=80, max_batch_tokens=32, max_num_seqs=4, max_model_len=1200)
    runner, captured = engine.runner, []
    runner.use_graphs = True  # the order only: the capture itself is recorded, not run (no CUDA here)
    monkeypatch.setattr(runner, "_capture", lambda host: captured.append(host.bucket) or runner.graphs.setdefault(
        host.bucket, None))
    report = engine.warmup(progress=False)
    sizes = [(b.max_seq_len, b.rows) for b in captured]
    assert report["graphs_captured"] == len(captured) == 4 * 3, captured  # contexts 256 .. 2048 x rows 1, 2, 4
    assert sizes == sorted(sizes, reverse=True), sizes


# ---- a long prefill: cost by position, progress on the stats line -------------------------------------
def test_prefill_steps_give_each_chunks_position_rows_and_time():
    engine = Engine(tiny_model(), num_blocks=16, max_batch_tokens=16)
    rid = engine.add_request(prompt(40, 1), 2)
    engine.step()
    assert prefill_progress(engine) == ["Prefill: 16/40 tokens (40%)"]
    loop = EngineLoop(engine)
    line = loop.stats_line(loop._counters(), loop._counters())
    assert line.endswith(", Prefill: 16/40 tokens (40%)"), line
    while engine.has_work():
        engine.step()
    steps = list(engine.stats.prefill_steps)
    assert [s.chunks for s in steps] == [((rid, 0, 16),), ((rid, 16, 16),), ((rid, 32, 8),)]
    assert all(s.ms > 0 and s.decode_rows == 0 for s in steps) and prefill_progress(engine) == []


# ---- dsa bench long ------------------------------------------------------------------------------------
def test_bench_long_at_tiny_lengths_writes_well_formed_json_and_a_figure(tmp_path, capsys):
    argv = ["bench", "long", "--device", "cpu", "--lengths", "128,256", "--new-tokens", "3", "--max-batch-tokens",
            "64", "--dense-up-to", "128", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("long-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["op"] == "long" and doc["env"]["git_sha"] and doc["env"]["cpus"] >= 1
    assert doc["args"]["command_line"] == "python -m dsa " + " ".join(argv) and doc["ceilings"] == {}
    rows = {(r["impl"], r["shape"]["L"]): r for r in doc["rows"]}
    assert sorted(rows) == [("dense", 128), ("dsa", 128), ("dsa", 256)]
    r = rows[("dsa", 256)]
    assert r["name"] == "long_prefill" and r["preset"] == "tiny" and r["max_model_len"] == 259
    assert r["ttft_s"] > 0 and r["prefill_tokens_per_s"] == pytest.approx(256 / r["ttft_s"])
    assert r["decode_tokens"] == 2 and r["decode_tokens_per_s"] > 0 and r["graph_steps"] == 0
    assert [c[:2] for c in r["chunks"]] == [[0, 64], [64, 64], [128, 64], [192, 64]] and all(c[2] > 0 for c in r["chunks"])
    c = PRESETS["tiny"]()
    pairs = 256 * 257 // 2 - c.index_topk * (c.index_topk + 1) // 2
    assert r["indexer_flops"] == 2 * c.index_n_heads * c.index_head_dim * pairs * 2  # FSFS: 2 layers index
    assert 0 < r["indexer_s"] < r["ttft_s"] and r["indexer_frac_fp8"] is None  # no FP8 ceiling on CPU
    assert rows[("dense", 128)]["indexer_flops"] == 0 and rows[("dense", 128)]["indexer_s"] == 0
    assert r["ragged_logits_kernel"] == "torch" and rows[("dense", 128)]["ragged_logits_kernel"] is None
    assert (tmp_path / (path.stem + ".png")).stat().st_size > 10000


@pytest.mark.parametrize("extra,message", [
    (["--lengths", "128,x"], "dsa bench long: --lengths: expected comma-separated positive token counts, got '128,x'"),
    (["--lengths", "0"], "dsa bench long: --lengths: expected comma-separated positive token counts, got '0'"),
    (["--new-tokens", "0"], "dsa bench long: --new-tokens must be at least 1, got 0"),
    (["--lengths", "256", "--max-model-len", "200"],
     "dsa bench long: --max-model-len 200 is less than the longest length plus --new-tokens (288)"),
])
def test_bench_long_refuses_bad_sizes_in_one_line(extra, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["bench", "long", "--device", "cpu", "--out", str(tmp_path)] + extra)
    assert str(e.value.code) == message


def test_max_model_len_is_refused_where_a_bench_does_not_use_it():
    with pytest.raises(SystemExit, match=r"^dsa bench engine: --max-model-len applies to `dsa bench long` and "
                                         r"`dsa bench serve` only$"):
        main(["bench", "engine", "--max-model-len", "1048576"])


def test_engine_with_max_model_len_samples_like_without():
    model = tiny_model()
    p = prompt(30, 3)
    sp = SamplingParams(max_tokens=4, temperature=0.7, seed=1)
    assert Engine(model, num_blocks=8, max_model_len=64).generate([p], sampling=sp) == \
        Engine(model, num_blocks=8).generate([p], sampling=sp)
