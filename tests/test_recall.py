"""``dsa recall`` end to end on a tiny random model, with answers known in advance."""
import json

import pytest
import torch

from dsa.cli import main
from dsa.quality.recall import _recall, measure
from model_utils import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, indexer_precision="fp8")


def test_cli_writes_json_and_plots(tmp_path, capsys):
    tokens = tmp_path / "prompt.txt"
    tokens.write_text(" ".join(str(t) for t in torch.randint(0, 512, (200,)).tolist()))
    out = tmp_path / "out"
    assert main(["recall", "--preset", "tiny", "--tokens", str(tokens), "--queries", "12", "--topk", "16,64",
                 "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads((out / "recall.json").read_text())
    assert {"args", "env", "layers", "by_position", "by_k"} <= set(result)
    assert len(result["layers"]) == 4 and result["args"]["context"] == 200
    for r in result["layers"]:
        assert {"layer", "runs_indexer", "fp8_vs_exact_recall", "mass_recall", "best_mass_recall",
                "reused_mass_recall"} <= set(r)
        assert (r["reused_mass_recall"] is None) == r["runs_indexer"]
    assert [r["k"] for r in result["by_k"]] == [16, 64]  # 64 is the preset's index_topk
    for name in ("recall_by_layer.png", "recall_by_position.png", "recall_by_k.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "layer  indexer" in capsys.readouterr().out


def test_k_at_least_context_gives_ones(model):
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(0))  # index_topk is 16
    result = measure(model, ids, [16, 64], num_queries=10, seed=0, progress=False)
    assert all(r["mass_recall"] == pytest.approx(1.0, abs=1e-5) for r in result["by_k"])
    for r in result["layers"]:
        assert r["mass_recall"] == pytest.approx(1.0, abs=1e-5)
        assert r["best_mass_recall"] == pytest.approx(1.0, abs=1e-5)
        assert r["fp8_vs_exact_recall"] in (None, 1.0)


def test_mass_recall_never_beats_the_best(model):
    ids = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(1))
    result = measure(model, ids, [8, 16, 32], num_queries=16, seed=1, progress=False)
    for r in result["layers"]:
        assert r["mass_recall"] <= r["best_mass_recall"] + 1e-6
    for r in result["by_k"]:
        assert r["mass_recall"] <= r["best_mass_recall"] + 1e-6
    for r in result["by_position"]:
        assert r["mass_recall"] <= r["best_mass_recall"] + 1e-6
    assert [r["k"] for r in result["by_k"]] == [8, 16, 32]


def test_a_selection_compared_with_itself_is_one():
    sel = torch.randperm(100)[:20]
    assert _recall(sel, sel) == 1.0 and _recall(sel[:10], sel) == 0.5


def test_a_model_without_an_indexer_is_refused_in_one_line(tmp_path, monkeypatch):
    """measure refuses it with a ValueError before any work; ``dsa recall`` exits with that line."""
    dense = tiny_model(index_topk=None)
    with pytest.raises(ValueError, match=r"^the model has no indexer \(index_topk is None\)$"):
        measure(dense, torch.arange(20), [16], num_queries=4, seed=0, progress=False)
    import dsa.model.model
    monkeypatch.setattr(dsa.model.model.DSAModel, "random", lambda *a, **k: dense)
    with pytest.raises(SystemExit) as e:
        main(["recall", "--device", "cpu", "--context", "64", "--out", str(tmp_path)])
    assert e.value.code == "dsa recall: the model has no indexer (index_topk is None)", e.value.code
    assert not list(tmp_path.iterdir()), "wrote results for a model it refused"
