"""Selection quality: metrics with known answers, the warm-up fit, ``dsa fit-indexer`` and ``dsa recall --teacher``."""
import json

import numpy as np
import pytest
import torch

from dsa.cli import main
from dsa.indexer import LightningIndexer
from dsa.quality import selection as quality, teacher_recall
from dsa.quality.selection import (
    agreement,
    hits,
    indexer_config,
    indexer_logits,
    load_indexers,
    mass,
    oracle,
    reuse_source,
    rope_tables,
    save_indexer,
    select,
    sink_recent,
    warmup_kl,
)
from dsa.quality.teacher import LlamaTeacher, attention_probs
from quality_utils import write_tiny_gguf


def peaked_probs(q: int, t: int, queries: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(q, t, generator=g) * 3
    s[:, 0] += 4  # a sink, as trained models have
    s = s.masked_fill(torch.arange(t)[None, :] > queries[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    info = write_tiny_gguf(path, seed=5, context=512)
    return path, info, LlamaTeacher.from_gguf(str(path), device="cpu")


# ---- known answers --------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 7, 40], ids=["k1", "k7", "k40"])
def test_k_at_least_the_past_keeps_all_mass(k):
    queries = torch.arange(k)  # every query sees at most k positions
    probs = peaked_probs(k, 50, queries, seed=k)
    for scores in (torch.randn(k, 50), -probs, probs):
        sel = select(scores, queries, k)
        assert torch.allclose(mass(probs, sel), torch.ones(k), atol=1e-6)
        assert torch.allclose(mass(probs, sel, skip_first=True)[1:], torch.ones(k - 1), atol=1e-5)


@pytest.mark.parametrize("k", [1, 5, 16], ids=["k1", "k5", "k16"])
def test_oracle_bounds_every_selection(k):
    t = 61
    queries = torch.tensor([20, 33, 47, 60])
    probs = peaked_probs(len(queries), t, queries, seed=k)
    best, best_ns = mass(probs, oracle(probs, queries, k)), mass(probs, oracle(probs, queries, k, True), True)
    candidates = [select(torch.randn(len(queries), t, generator=torch.Generator().manual_seed(s)), queries, k)
                  for s in range(5)] + [select(-probs, queries, k)]
    if k > quality.SINK:
        candidates.append(sink_recent(queries, k))
    for sel in candidates:
        assert (mass(probs, sel) <= best + 1e-6).all(), (mass(probs, sel), best)
        assert (mass(probs, sel, skip_first=True) <= best_ns + 1e-6).all()


def test_sink_recent_positions():
    sel = sink_recent(torch.tensor([9, 20]), 8)
    assert sel.tolist() == [[0, 1, 2, 3, 9, 8, 7, 6], [0, 1, 2, 3, 20, 19, 18, 17]]
    assert sel.dtype == torch.int32


def test_mass_without_token_zero():
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0]])
    assert mass(probs, torch.tensor([[0, 1, -1]])).item() == pytest.approx(0.7)
    assert mass(probs, torch.tensor([[0, 1, -1]]), skip_first=True).item() == pytest.approx(0.4)
    assert mass(probs, torch.tensor([[1, 2, 3]]), skip_first=True).item() == pytest.approx(1.0)


def test_agreement_and_hits():
    a = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[3, 2, 9, 8], [5, 4, -1, -1]], dtype=torch.int32)
    assert agreement(a, b, 10).tolist() == [0.5, 1.0]
    assert hits(a, torch.tensor([2, 6])).tolist() == [True, False]


def test_reuse_source_patterns():
    assert reuse_source(range(8), 1) == {i: i for i in range(8)}
    assert reuse_source(range(8), 2) == {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4, 6: 6, 7: 6}
    assert reuse_source(range(8), 4, num_layers=10) == {i: 0 if i < 4 else 4 for i in range(8)} | {8: 4, 9: 4}
    assert reuse_source([2, 3], 1, num_layers=5) == {2: 2, 3: 3, 4: 3}  # layers 0-1 have no source: dense


def test_warmup_kl():
    queries = torch.tensor([3, 9])
    probs = peaked_probs(2, 12, queries, seed=0)
    logits = torch.log(probs)  # -inf past each query, like indexer logits
    assert warmup_kl(logits, probs).item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(2, 12).masked_fill(torch.arange(12)[None] > queries[:, None], float("-inf"))
    want = sum(torch.nn.functional.kl_div(torch.log_softmax(other[j, :p + 1], -1), probs[j, :p + 1], reduction="sum")
               for j, p in enumerate(queries.tolist())) / 2
    assert warmup_kl(other, probs).item() == pytest.approx(want.item(), rel=1e-5)


def test_logits_equal_to_attention_reach_the_oracle(tiny, monkeypatch):
    """Through the whole recall accounting: an 'indexer' whose logits are the layer's attention selects
    the oracle's set at every layer and k, so fitted == oracle and FP8 vs exact agree fully."""
    _, info, teacher = tiny
    captured = {}

    def attention_as_logits(indexer, x, queries, cos, sin, precision):
        return captured["probs"].log()

    def capture(i, x, q, k):
        captured["probs"] = attention_probs(q, k, captured["queries"])
    monkeypatch.setattr(teacher_recall, "indexer_logits", attention_as_logits)
    layer0 = LightningIndexer(indexer_config(teacher.config, 2))
    ev = {"fitted_fp8": {0: layer0, 1: layer0}, "fitted_exact": {0: layer0, 1: layer0}, "untrained": {0: layer0, 1: layer0},
          "layers": {0, 1}, "sources": {f: reuse_source([0, 1], f) for f in teacher_recall.PATTERNS},
          "cos": None, "sin": None}
    ids = torch.randint(0, info["vocab"], (200,), generator=torch.Generator().manual_seed(2))
    queries = torch.tensor([10, 70, 130, 199])
    captured["queries"] = queries
    tally = teacher_recall.Tally()
    monkeypatch.setattr(teacher, "block", _observing(teacher.block, capture))
    teacher_recall.score(teacher, ids, queries, [16, 64, 128], ev, tally)
    rows = teacher_recall.table(tally, [0, 1], [16, 64, 128])
    for r in rows:
        assert r["queries"] == int((queries + 1 > r["k"]).sum())  # queries whose past fits in k are left out
        assert r["fitted_fp8"] == pytest.approx(r["oracle"], abs=1e-6) and r["fitted_exact"] == pytest.approx(r["oracle"])
        assert r["fp8_vs_exact"] == 1.0 and r["sink_recent"] <= r["oracle"] + 1e-6


def _observing(block, capture):
    def wrapped(i, h, select=None, observe=None):
        def both(i, x, q, k):
            capture(i, x, q, k)
            if observe is not None:
                observe(i, x, q, k)
        return block(i, h, select, both)
    return wrapped


# ---- indexer logits, fitting, files -----------------------------------------------------------------
def test_fp8_logits_track_exact(tiny):
    _, info, teacher = tiny
    ids = torch.randint(0, info["vocab"], (150,), generator=torch.Generator().manual_seed(3))
    xs = {}
    teacher.hidden(ids, layers=1, observe=lambda i, x, q, k: xs.setdefault(i, x))
    torch.manual_seed(0)
    cfg = indexer_config(teacher.config, 2)
    exact = LightningIndexer(cfg)
    fp8 = LightningIndexer(cfg).to(torch.bfloat16)
    fp8.load_state_dict(exact.state_dict())
    cos, sin = rope_tables(cfg, 150, "cpu")
    queries = torch.tensor([40, 99, 149])
    a = indexer_logits(exact, xs[0], queries, cos, sin, "exact")
    b = indexer_logits(fp8, xs[0], queries, cos, sin, "fp8")
    assert a.shape == b.shape == (3, 150)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[0, 41:]).all()
    agree = agreement(select(b, queries, 16), select(a, queries, 16), 150)
    assert agree.mean().item() >= 0.85, agree
    with pytest.raises(TypeError, match="bfloat16"):
        indexer_logits(exact, xs[0], queries, cos, sin, "fp8")


def test_indexer_files_round_trip(tiny, tmp_path):
    """``wq_b`` and ``wk`` are stored as FP8 blocks (dequantized on load, as the model loader does), the rest
    in bf16; a file of bf16 weights (the earlier format) loads as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dsa.model.loading import dequantize_fp8_block, quantize_fp8_block

    teacher = tiny[2]
    idx = LightningIndexer(indexer_config(teacher.config, 2))
    save_indexer(idx, 1, str(tmp_path), {"teacher": "tiny"})
    with safe_open(str(tmp_path / "layer_01.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes["wq_b.weight"] == dtypes["wk.weight"] == torch.float8_e4m3fn, dtypes
    assert dtypes["weights_proj.weight"] == torch.bfloat16 and "wq_b.weight_scale_inv" in dtypes
    loaded = load_indexers(str(tmp_path), teacher.config)
    assert list(loaded) == [1]
    for name, v in idx.state_dict().items():
        want = dequantize_fp8_block(*quantize_fp8_block(v)) if name in ("wq_b.weight", "wk.weight") else \
            v.to(torch.bfloat16).float()
        assert torch.equal(loaded[1].state_dict()[name], want), name
    (tmp_path / "bf16").mkdir()
    with safe_open(str(tmp_path / "layer_01.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file({k: v.to(torch.bfloat16) for k, v in idx.state_dict().items()}, str(tmp_path / "bf16" / "layer_01.safetensors"),
              metadata=meta)
    old = load_indexers(str(tmp_path / "bf16"), teacher.config)
    for name, v in idx.state_dict().items():
        assert torch.equal(old[1].state_dict()[name], v.to(torch.bfloat16).float()), name
    with pytest.raises(FileNotFoundError, match="no folder"):
        load_indexers(str(tmp_path / "missing"), teacher.config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no layer_XX"):
        load_indexers(str(tmp_path / "empty"), teacher.config)


# ---- the warm-up fit's time budget ---------------------------------------------------------------------
class FakeClock:
    """Each layer of a teacher pass (a held-out window or a training step) takes ``layer_s`` seconds,
    nothing else any."""

    def __init__(self, teacher, monkeypatch, layer_s):
        self.now = 0.0
        real = type(teacher).hidden

        def hidden(this, ids, layers=None, select=None, observe=None):
            def tick(*a):
                self.now += layer_s
                if observe is not None:
                    observe(*a)
            return real(this, ids, layers=layers, select=select, observe=tick)
        monkeypatch.setattr(type(teacher), "hidden", hidden)

    def __call__(self):
        return self.now


@pytest.mark.parametrize("budget,before,steps,after", [(100.0, 2, 6, 2), (50.0, 1, 3, 1), (45.0, 0, 3, 0),
                                                       (4.0, 0, 0, 0), (None, 4, 7, 4)],
                         ids=["room-for-6-steps", "tight", "a-window-does-not-fit-its-share", "nothing-fits",
                              "no-budget"])
def test_max_seconds_bounds_evaluation_and_training(tiny, monkeypatch, budget, before, steps, after):
    """5 s per layer, 2 layers: with 100 s the KL before gets a fifth (2 windows of 4 in 20 s), training
    keeps 2 windows' time for the KL after, which evaluates the same windows; a pass that outlasts its
    phase is abandoned after a layer, so nothing runs more than one layer past the budget."""
    from dsa.quality.fit import fit, sample_queries
    from dsa.quality.retrieval_mix import window_source
    _, info, teacher = tiny
    g = torch.Generator().manual_seed(0)
    train = {"train": np.random.default_rng(0).integers(0, info["vocab"], 2000)}
    held = [(torch.randint(0, info["vocab"], (128,), generator=g), sample_queries(128, 8, 16, g)) for _ in range(4)]
    clock = FakeClock(teacher, monkeypatch, layer_s=5.0)
    _, record = fit(teacher, [0, 1], window_source(train, 128, 8, 16), held, heads=2, context=128, steps=7,
                    max_seconds=budget, seed=0, progress=False, clock=clock)
    got = (record["heldout_windows"]["before"], record["steps"], record["heldout_windows"]["after"])
    assert got == (before, steps, after), f"budget {budget}: (before, steps, after) = {got}, ended at {clock.now} s"
    if budget is not None:
        assert clock.now <= budget + 5.0, f"ran to {clock.now} s of a {budget} s budget"
    assert len(record["heldout_kl_before"]) == (2 if before else 0) and bool(record["heldout_kl_after"]) == bool(after)


def test_fit_indexer_max_minutes_writes_its_results_and_says_how_many_windows(tiny, tmp_path, monkeypatch, capsys):
    """8 s per layer in a 90 s budget: one of 3 held-out windows fits in its fifth, 3 steps, results written."""
    import dsa.quality.fit as fit_module
    path, info, teacher = tiny
    real_fit = fit_module.fit
    monkeypatch.setattr(fit_module, "fit", lambda *a, **k: real_fit(
        *a, **{**k, "clock": FakeClock(teacher, monkeypatch, layer_s=8.0)}))
    np.save(tmp_path / "train.npy", np.random.default_rng(0).integers(0, info["vocab"], 1000).astype(np.uint16))
    np.save(tmp_path / "held.npy", np.random.default_rng(1).integers(0, info["vocab"], 1000).astype(np.uint16))
    assert main(["fit-indexer", "--gguf", str(path), "--train", str(tmp_path / "train.npy"), "--heldout",
                 str(tmp_path / "held.npy"), "--index-heads", "2", "--context", "256", "--eval-windows", "3",
                 "--max-minutes", "1.5", "--device", "cpu", "--out", str(tmp_path / "fit")]) == 0
    record = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert record["steps"] == 3 and record["heldout_windows"] == {"given": 3, "before": 1, "after": 1}, record
    assert (tmp_path / "fit" / "fit_loss.png").exists() and (tmp_path / "fit" / "layer_01.safetensors").exists()
    out = capsys.readouterr().out
    assert "held-out KL on 1 of 3 windows (the others did not fit in --max-minutes)" in out, out


# ---- the commands ------------------------------------------------------------------------------------
def test_fit_indexer_and_recall_teacher_cli(tiny, tmp_path, capsys):
    path, info, _ = tiny
    rng = np.random.default_rng(0)
    words = ["the", "pass", "key", "in", "here", "there", "12", "7", "at", "he"]
    (tmp_path / "train.txt").write_text(" ".join(rng.choice(words, 3000)) + "<|endoftext|>" + " ".join(rng.choice(words, 500)))
    np.save(tmp_path / "held.npy", rng.integers(0, info["vocab"], 800).astype(np.uint16))
    fit_dir, out = tmp_path / "fit", tmp_path / "recall"
    assert main(["fit-indexer", "--gguf", str(path), "--train", str(tmp_path / "train.txt"), "--heldout",
                 str(tmp_path / "held.npy"), "--layers", "all", "--index-heads", "2", "--context", "256", "--queries",
                 "16", "--min-position", "32", "--steps", "3", "--eval-windows", "1", "--eval-queries", "8", "--out",
                 str(fit_dir)]) == 0
    record = json.loads((fit_dir / "fit.json").read_text())
    assert record["steps"] == 3 and record["layers"] == [0, 1] and set(record["heldout_kl_after"]) == {"0", "1"}
    assert sorted(p.name for p in fit_dir.glob("*.safetensors")) == ["layer_00.safetensors", "layer_01.safetensors"]
    assert (fit_dir / "fit_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["recall", "--teacher", str(path), "--indexers", str(fit_dir), "--text", str(tmp_path / "held.npy"),
                 "--teacher-preset", "cpu", "--context", "256", "--layers", "all", "--topk", "16,64", "--queries", "8",
                 "--copy-seqs", "1", "--passkey-seqs", "1", "--target-k", "16", "--sparse-loss", "--out", str(out)]) == 0
    result = json.loads((out / "quality.json").read_text())
    assert {"args", "env", "teacher", "table", "summary", "sparse_loss", "sequences"} <= set(result)
    assert {(r["layer"], r["k"]) for r in result["table"]} == {(i, k) for i in (0, 1) for k in (16, 64)}
    for r in result["table"]:
        assert r["fitted_fp8"] <= r["oracle"] + 1e-6 and r["sink_recent"] <= r["oracle"] + 1e-6
        assert r["copy_hits"]["oracle"] is not None and r["passkey_hits"]["oracle"] is not None
        assert set(r["skip_pattern"]) == {"1", "2", "4"} and 0.0 <= r["attention_on_token0"] <= 1.0
    sp = result["sparse_loss"]
    assert [r["k"] for r in sp["by_k"]] == [16, 64] and set(sp["by_k"][0]["fitted"]) == {"1", "2", "4"}
    assert "sparse_loss_gap" in result["summary"]["targets"]
    for name in ("quality_by_layer.png", "quality_by_k.png", "sparse_loss.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "k = 16: attention mass kept" in capsys.readouterr().out
