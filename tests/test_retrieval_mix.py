"""The retrieval fit (``dsa fit-indexer --retrieval --sparse-share --init``): its windows put the rows that look
something up among the queries, its sparse stage is V3.2's selected-set KL, and it continues from fitted
indexers (a tiny random GGUF teacher)."""
import numpy as np
import pytest
import torch

from dsa.indexer import LightningIndexer
from dsa.quality import retrieval_mix
from dsa.quality.corpus import sample_window
from dsa.quality.fit import fit, heldout_kl, sample_queries, sparse_phase, step_losses
from dsa.quality.retrieval_mix import copy_window, needle_window, retrieval_window, window_source
from dsa.quality.selection import indexer_config, indexer_logits, rope_tables, topk_mask, warmup_kl
from dsa.quality.teacher import LlamaTeacher, attention_probs
from quality_utils import write_tiny_gguf

WORDS = ["the", "pass", "key", "in", "here", "there", "12", "7", "at", "he", "river.", "house."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    info = write_tiny_gguf(path, seed=4, context=2048)
    teacher = LlamaTeacher.from_gguf(str(path), device="cpu")
    rng = np.random.default_rng(0)
    streams = {"prose": np.asarray(teacher.tokenizer.encode(" ".join(rng.choice(WORDS, 6000))).ids, dtype=np.int64)}
    return teacher, info, streams


def _occurs_before(ids: torch.Tensor, span: torch.Tensor, end: int) -> bool:
    windows = ids[:end].unfold(0, len(span), 1)
    return bool((windows == span).all(1).any())


@pytest.mark.parametrize("seed", [0, 1, 2, 3], ids=lambda s: f"seed{s}")
def test_a_copy_windows_rows_are_its_second_copy(tiny, seed):
    teacher, info, streams = tiny
    g = torch.Generator().manual_seed(seed)
    ids, rows = copy_window(streams, 1000, info["vocab"], g)
    assert ids.numel() == 1000 and rows.numel() >= retrieval_mix.SPAN[0] - 1
    assert bool((rows[1:] - rows[:-1] == 1).all()), "one contiguous run of rows"
    span = ids[rows[0]:rows[-1] + 2]  # the copy, the token each row predicts included
    assert _occurs_before(ids, span, int(rows[0]) - 64 + 1), "the span appears at least 64 tokens earlier"


@pytest.mark.parametrize("task", ["needle", "multikey", "passkey"])
def test_a_needle_windows_rows_run_from_the_question_to_the_answer(tiny, task):
    teacher, _, streams = tiny
    g = torch.Generator().manual_seed(7)
    ids, rows = needle_window(streams, 700, task, teacher.tokenizer, g)
    assert ids.numel() == 700 and int(rows[-1]) == 698, "the last row predicts the answer's last token"
    question = teacher.tokenizer.decode(ids[rows[0] + 1:].tolist())
    assert ("pass key" in question) if task == "passkey" else question.startswith("\nWhat is the special magic")


@pytest.mark.parametrize("context,queries", [(1024, 40), (2048, 300), (4096, 17)], ids=["1k-40", "2k-300", "4k-17"])
def test_a_retrieval_window_holds_its_rows_among_sorted_unique_queries(tiny, context, queries):
    teacher, info, streams = tiny
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        ids, q, episode = retrieval_window(streams, context, queries, 32, teacher.tokenizer, info["vocab"], g)
        t = ids.numel()
        assert t in [n for n in retrieval_mix.LENGTHS if n <= context] or (context < 2048 and t == context)
        assert q.numel() == queries and bool((q[1:] > q[:-1]).all()) and 0 <= int(q[0]) and int(q[-1]) < t
        if episode == "copy":  # a run of >= 15 consecutive rows (all the queries when they are fewer)
            run = (q[1:] - q[:-1] == 1).int()
            longest = max(len(r) for r in "".join(map(str, run.tolist())).split("0")) + 1
            assert longest >= min(15, queries), f"seed {seed}: longest run of rows {longest}"
        else:
            assert int(q[-1]) == t - 2, f"seed {seed} ({episode}): the answer rows are kept first"


def test_without_retrieval_the_source_draws_what_the_natural_fit_drew(tiny):
    _, info, streams = tiny
    draw = window_source(streams, 512, 24, 64)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        ids, q = draw(g1)
        assert ids.equal(sample_window(streams, 512, g2)) and q.equal(sample_queries(512, 24, 64, g2))


def test_the_retrieval_share_decides_the_windows(tiny):
    teacher, info, streams = tiny
    g = torch.Generator().manual_seed(0)
    always = window_source(streams, 2048, 64, 64, 1.0, teacher.tokenizer, info["vocab"])
    never = window_source(streams, 1536, 64, 64, 0.0)
    assert all(always(g)[0].numel() == 2048 for _ in range(4))  # 2048: the only LENGTHS entry that fits
    assert all(never(g)[0].numel() == 1536 for _ in range(4))
    with pytest.raises(ValueError, match="retrieval"):
        window_source(streams, 512, 8, 8, 1.5)
    with pytest.raises(ValueError, match="tokenizer"):
        window_source(streams, 512, 8, 8, 0.5)


# ---- the sparse stage -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tiny):
    teacher, info, _ = tiny
    torch.manual_seed(0)
    idx = {i: LightningIndexer(indexer_config(teacher.config, 2)) for i in (0, 1)}
    cos, sin = rope_tables(idx[0].config, 300, "cpu")
    ids = torch.randint(0, info["vocab"], (300,), generator=torch.Generator().manual_seed(1))
    return teacher, idx, cos, sin, ids, torch.tensor([3, 40, 41, 150, 299])


def test_the_sparse_stage_with_k_past_every_row_is_the_dense_warmup(setup):
    teacher, idx, cos, sin, ids, q = setup
    dense = step_losses(teacher, idx, ids, q, cos, sin, None)
    wide = step_losses(teacher, idx, ids, q, cos, sin, 300)
    for i in dense:
        assert torch.allclose(dense[i], wide[i], atol=1e-6), f"layer {i}: {dense[i]} vs {wide[i]}"


def test_the_sparse_stage_is_the_kl_over_the_indexers_own_top_k(setup):
    teacher, idx, cos, sin, ids, q = setup
    got = step_losses(teacher, idx, ids, q, cos, sin, 16)
    seen = {}
    teacher.hidden(ids, layers=2, observe=lambda i, x, qq, kk: seen.setdefault(i, (x, qq, kk)))
    for i, (x, qq, kk) in seen.items():
        logits = indexer_logits(idx[i], x, q, cos, sin, "exact")
        keep = topk_mask(logits, 16)
        assert keep.sum(1).tolist() == [4, 16, 16, 16, 16], "rows whose past fits keep all of it"
        p = attention_probs(qq, kk, q, allowed=keep)
        lq = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
        want = torch.where(keep, p * (torch.log(p.clamp(min=1e-30)) - torch.where(keep, lq, 0.0)), 0.0).sum(1).mean()
        assert torch.allclose(got[i], want, atol=1e-5), f"layer {i}: {got[i]} vs {want}"
        assert not torch.allclose(got[i], warmup_kl(logits, attention_probs(qq, kk, q)), atol=1e-4)


@pytest.mark.parametrize("step,t,budget,share,want", [(0, 0.0, None, 0.25, False), (74, 0.0, None, 0.25, False),
                                                      (75, 0.0, None, 0.25, True), (99, 9.0, 100.0, 0.25, False),
                                                      (0, 75.0, 100.0, 0.25, True), (99, 99.0, 100.0, 0.0, False)],
                         ids=["first", "before-share", "in-share", "time-before", "time-in", "no-share"])
def test_the_sparse_stage_is_the_last_share_of_steps_or_time(step, t, budget, share, want):
    assert sparse_phase(step, 100, t, budget, share) is want


def test_a_fit_continues_from_its_init_and_runs_both_stages(tiny, setup):
    teacher, info, streams = tiny
    _, idx, cos, sin, ids, q = setup
    held = [(ids, q)]
    start = heldout_kl(teacher, idx, held, cos, sin)[0]
    saved = []
    got, record = fit(teacher, [0, 1], window_source(streams, 256, 16, 8), held, heads=2, context=300, steps=6,
                      seed=0, init=idx, sparse_share=0.5, checkpoint=lambda m, r, s: saved.append((r["steps"], s)),
                      checkpoint_seconds=0.0, progress=False)
    assert record["heldout_kl_before"] == pytest.approx(start, abs=1e-6), "the fit starts where its init ended"
    assert record["steps_by_stage"] == {"dense": 3, "sparse": 3}
    assert [c["stage"] for c in record["curve"]] == ["dense"] * 3 + ["sparse"] * 3
    assert saved == [(1, None), (2, None), (3, None), (3, "dense"), (4, None), (5, None), (6, None)], \
        "a checkpoint after every step at checkpoint_seconds=0, and the dense stage's end"
    assert not torch.equal(got[0].wq_b.weight, idx[0].wq_b.weight), "trained"
    with pytest.raises(ValueError, match="heads"):
        fit(teacher, [0], window_source(streams, 256, 16, 8), held, heads=4, context=300, steps=1, init=idx,
            progress=False)


# ---- the command --------------------------------------------------------------------------------------
def test_fit_indexer_fits_for_retrieval_then_continues_from_its_files(tiny, tmp_path, capsys):
    import json

    from dsa.cli import main
    from dsa.quality.selection import load_indexers

    teacher, info, streams = tiny
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, seed=4, context=2048)
    np.save(tmp_path / "train.npy", streams["prose"].astype(np.uint16))
    base = ["fit-indexer", "--gguf", path, "--train", str(tmp_path / "train.npy"), "--layers", "0-1",
            "--index-heads", "2", "--context", "1024", "--queries", "16", "--device", "cpu"]
    assert main([*base, "--steps", "4", "--retrieval", "1", "--sparse-share", "0.5", "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "fit.json").read_text())
    dense = json.loads((tmp_path / "a" / "dense-stage" / "fit.json").read_text())
    assert not dense["complete"] and dense["steps"] == 2
    assert (tmp_path / "a" / "dense-stage" / "layer_01.safetensors").exists()
    assert first["complete"] and first["steps_by_stage"] == {"dense": 2, "sparse": 2}
    assert {c["tokens"] for c in first["curve"]} == {1024}  # retrieval windows: no LENGTHS entry fits 1024
    assert main([*base, "--steps", "2", "--init", str(tmp_path / "a"), "--index-heads", "7", "--out",
                 str(tmp_path / "b")]) == 0
    second = load_indexers(str(tmp_path / "b"), teacher.config)
    assert second[0].config.index_n_heads == 2, "--init decides the heads"
    capsys.readouterr()
    assert main([*base, "--steps", "2", "--max-minutes", "60", "--sparse-share", "0.5", "--out", str(tmp_path / "d")]) == 0
    assert "no sparse step ran: --steps 2 ended the fit" in capsys.readouterr().out, "said when the time share never came"
    for flags, message in ((["--retrieval", "2"], "--retrieval"), (["--sparse-share", "-0.1"], "--sparse-share"),
                           (["--sparse-k-fraction", "0"], "--sparse-k-fraction"),
                           (["--checkpoint-minutes", "0"], "--checkpoint-minutes")):
        with pytest.raises(SystemExit, match=message):
            main([*base, *flags, "--out", str(tmp_path / "c")])
