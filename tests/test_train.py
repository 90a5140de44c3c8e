"""Training the default model (dsa.quality.train, benchmarks/train_default/train.py) on CPU, tiny.

The differentiable paths compute what DSAModel computes; each stage trains the right parameters
(b: only the indexers; c: the indexer KL reaches only the indexers, the LM loss only the model); an
export loads in DSAModel, transformers' DeepseekV32ForCausalLM and dsa.LLM with matching logits.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dsa.model import DSAModel
from dsa.quality import train as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = [open(os.path.join(ROOT, "tests", "data", f"sotu-{y}-opening.txt")).read() for y in (1790, 1996)]


def tiny_model(seed=0, vocab=300):
    return T.new_model(T.model_config(vocab, 2, 128, 256, index_heads=4), seed, "cpu")


def ids_batch(b=2, s=64, vocab=300, seed=1):
    return torch.randint(2, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def inference_copy(model, **changes):
    m = DSAModel(model.config.replace(indexer_precision="exact", **changes))
    m.load_state_dict(model.state_dict())
    return m.finalize(torch.float32, "cpu")


def test_paths_match_dsamodel():
    model = tiny_model()
    with torch.no_grad():  # wider than the init, so selections differ from "the last k positions"
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    ids = ids_batch()  # 64 tokens > index_topk = 16: the sparse regime
    with torch.no_grad():
        sparse, _ = T.run(model, ids, "sparse")
        dense, _ = T.run(model, ids, "dense")
    torch.testing.assert_close(sparse, inference_copy(model)(ids), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense, inference_copy(model, index_topk=64)(ids), atol=1e-4, rtol=1e-4)
    assert (sparse - dense).abs().max() > 1e-2  # the selection matters


def _steps(model, stage, ids, n=4, lr=3e-3):
    params = T.set_trainable(model, stage)
    opt = torch.optim.AdamW(params, lr=lr)
    rows = torch.arange(16, 64, 4)
    losses = []
    for _ in range(n):
        loss, row = T.stage_loss(model, ids, stage, rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(row)
    return params, losses


def test_stages_train_the_right_parameters():
    model, ids = tiny_model(), ids_batch()
    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    params, losses = _steps(model, "dense", ids)
    assert all(".indexer." not in names[id(p)] for p in params)
    assert losses[-1]["lm"] < losses[0]["lm"]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".indexer." not in n for n in changed)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params, losses = _steps(model, "warmup", ids, n=6, lr=1e-2)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n in before if ".indexer." in n}  # stage b: only the indexers move
    assert losses[-1]["kl"] < losses[0]["kl"]

    _, losses = _steps(model, "sparse", ids)
    assert all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in losses)
    assert losses[-1]["lm"] < losses[0]["lm"]


def test_sparse_indexer_input_detached():
    model, ids = tiny_model(), ids_batch()
    T.set_trainable(model, "sparse")
    logits, kls = T.run(model, ids, "sparse", kl_rows=torch.arange(16, 64, 4))
    grads = torch.autograd.grad(torch.stack(kls).sum(), list(model.parameters()), allow_unused=True)
    for (n, _), g in zip(model.named_parameters(), grads):
        assert (g is not None and g.abs().sum() > 0) == (".indexer." in n), n  # the KL reaches only the indexers
    grads = torch.autograd.grad(T.lm_loss(logits, ids), list(model.parameters()), allow_unused=True)
    for (n, _), g in zip(model.named_parameters(), grads):
        assert (g is None) == (".indexer." in n), n  # the LM loss never reaches the indexers (top-k)


def _lowest_first_topk(self, k, dim=-1, largest=True, sorted=True):
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def test_export_loads_everywhere(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "train.txt"
    text.write_text(f"\n{T.EOS}\n".join(TEXT))
    tok = T.train_tokenizer([str(text)], 300, str(tmp_path / "tokenizer.json"))
    ids = torch.from_numpy(T.tokenize_file(str(text), tok).astype("int64"))
    model = tiny_model(vocab=tok.get_vocab_size())
    batch = torch.stack([ids[:64], ids[64:128]])
    for stage in T.STAGES:
        _steps(model, stage, batch, n=2)
    out = T.export(model.eval(), str(tmp_path / "tokenizer.json"), str(tmp_path / "model"))
    with torch.no_grad():
        ours, _ = T.run(model, batch, "sparse")

    loaded = DSAModel.from_pretrained(out, dtype=torch.float32, device="cpu", indexer_precision="exact")
    assert loaded.config.model_type == "deepseek_v32" and loaded.config.index_topk == 16
    got = loaded(batch)
    torch.testing.assert_close(got, ours, atol=1e-4, rtol=1e-4)

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", _lowest_first_topk)
        ref = hf(batch).logits.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1).double(), ref.flatten(0, 1).double(), dim=-1)
    assert cos.mean() >= 0.999  # test_interop's float32 tolerances
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97

    import dsa
    llm = dsa.LLM(out, device="cpu", dtype=torch.float32)
    assert llm.tokenizer.bos_token_id == 0 and llm.tokenizer.eos_token_id == 1
    done = llm.generate(["Fellow-Citizens of"], dsa.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(done[0].token_ids) == 4
    assert llm.chat([{"role": "user", "content": "hi"}], dsa.SamplingParams(max_tokens=2, temperature=0))


def test_mtp_loss_trains_the_mtp_module_and_the_model():
    model, ids = tiny_model(), ids_batch()
    mtp = T.new_mtp(model.config, 0, "cpu")
    params = T.set_trainable(model, "dense", mtp)
    assert {id(p) for p in mtp.parameters() if p.requires_grad} <= {id(p) for p in params}
    _, _, mtp_logits = T.run_with_mtp(model, mtp, ids, "dense")
    assert mtp_logits.shape == (2, 63, 300)
    named = [(n, p) for n, p in T._named(model, mtp) if p.requires_grad]
    assert not any(".indexer." in n for n, _ in named)
    grads = torch.autograd.grad(T.mtp_loss(mtp_logits, ids), [p for _, p in named], allow_unused=True)
    reached = {n for (n, _), g in zip(named, grads) if g is not None and g.abs().sum() > 0}
    assert {"mtp.eh_proj.weight", "mtp.shared_head.norm.weight", "embed_tokens.weight", "lm_head.weight",
            "layers.0.mlp.up_proj.weight"} <= reached, reached  # through h[i] into the main model too
    loss, row = T.stage_loss(model, ids, "sparse", torch.arange(16, 64, 4), mtp)
    assert set(row) == {"lm", "kl", "mtp"}
    torch.testing.assert_close(loss, torch.tensor(row["lm"] + row["kl"] + T.MTP_WEIGHT * row["mtp"]))


@pytest.mark.parametrize("shape", [(256, 384), (576, 384), (8, 384), (130, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp8_block_quantization_round_trips_through_the_loader(shape):
    from dsa.model.loading import dequantize_fp8_block, quantize_fp8_block
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, shape[1])
    w8, scale_inv = quantize_fp8_block(w)
    assert w8.dtype == torch.float8_e4m3fn and scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8_block(w8, scale_inv)
    err = ((back - w).abs() / w.abs().clamp_min(1e-6)).median()
    assert err < 0.04, f"median relative error {err:.4f} (e4m3 keeps 3 mantissa bits)"


def test_fp8_export_with_mtp_loads_in_dsamodel_and_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "train.txt"
    text.write_text(f"\n{T.EOS}\n".join(TEXT))
    T.train_tokenizer([str(text)], 300, str(tmp_path / "tokenizer.json"))
    config = T.model_config(300, 2, 128, 256, index_heads=4, q_lora_rank=128, intermediate_size=256)
    model, mtp = T.new_model(config, 0, "cpu").eval(), T.new_mtp(config, 0, "cpu").eval()
    out = T.export(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "model"), mtp=mtp, fp8=True)
    hf_config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert hf_config["num_nextn_predict_layers"] == 1
    assert hf_config["quantization_config"]["modules_to_not_convert"] == ["kv_a_proj_with_mqa", "lm_head",
                                                                         "weights_proj"]
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").dtype == torch.float32
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.indexer.wk.weight"} <= names
    ids = ids_batch()
    loaded = DSAModel.from_pretrained(out, dtype=torch.float32, device="cpu", indexer_precision="exact")
    assert loaded.config.num_hidden_layers == 2  # the MTP layer is read past, not built
    got = loaded(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1).double(), ref.flatten(0, 1).double(), dim=-1)
    assert cos.mean() >= 0.998, f"mean cosine {cos.mean():.5f}"  # transformers dequantizes to bf16 on CPU


def test_refit_imports_an_export_and_replaces_only_its_indexers(tmp_path):
    """``import_export`` inverts the FP8 export (re-exporting gives the same bytes); ``replace_indexers``
    changes the indexer tensors and leaves every other tensor byte for byte."""
    from safetensors.torch import load_file

    text = tmp_path / "train.txt"
    text.write_text(f"\n{T.EOS}\n".join(TEXT))
    T.train_tokenizer([str(text)], 300, str(tmp_path / "tokenizer.json"))
    config = T.model_config(300, 2, 128, 256, index_heads=4, q_lora_rank=128, intermediate_size=256)
    model, mtp = T.new_model(config, 0, "cpu").eval(), T.new_mtp(config, 0, "cpu").eval()
    src = T.export(model, str(tmp_path / "tokenizer.json"), str(tmp_path / "src"), dtype=torch.bfloat16, mtp=mtp,
                   fp8=True)
    back, back_mtp = T.import_export(src, "cpu")
    assert back_mtp is not None and back.config.n_routed_experts is None

    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    before = load_file(os.path.join(src, "model.safetensors"))
    again = T.export_tensors(back, back_mtp, torch.bfloat16, fp8=True)
    assert sorted(again) == sorted(before)
    changed = [n for n in before if not torch.equal(raw(before[n]), raw(again[n]))]
    assert not changed, f"re-exported tensors differ: {changed[:4]}"
    with torch.no_grad():
        for n, p in list(back.named_parameters()) + list(back_mtp.named_parameters()):
            if ".indexer." in n:
                p.add_(0.01)
    done = T.replace_indexers(src, back, back_mtp, str(tmp_path / "out"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    indexer = {n for n in before if ".indexer." in n}
    assert done == {"replaced": len(indexer), "kept": len(before) - len(indexer)}
    differ = {n for n in before if not torch.equal(raw(before[n]), raw(after[n]))}
    assert differ and differ <= indexer, f"changed outside the indexers: {sorted(differ - indexer)[:4]}"
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(src))


def _train_script():
    """benchmarks/train_default/train.py as a module: its ``main(argv)`` runs in this process (each
    subprocess would pay the torch import again); test_script_warns_before_training_on_cpu runs it as
    a script."""
    spec = importlib.util.spec_from_file_location("train_default_train", os.path.join(ROOT, "benchmarks",
                                                                                       "train_default", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_script_end_to_end(tmp_path, monkeypatch, capsys):
    """``prepare`` + ``train`` on two short texts, one step per stage: train.json, the plot, the export."""
    for split, body in (("train", f"\n{T.EOS}\n".join([TEXT[0]] * 4)), ("heldout", TEXT[1])):
        (tmp_path / "text" / split).mkdir(parents=True)
        (tmp_path / "text" / split / "sotu.txt").write_text(body)
    script = _train_script()

    def run(argv):  # as `python train.py ARGV` would: sys.argv is what the records' "command" shows
        monkeypatch.setattr(sys, "argv", [script.__file__, *argv])
        with torch.random.fork_rng():  # the script seeds torch: leave the other tests' generator as it was
            assert script.main(argv) == 0
        return capsys.readouterr()

    run(["prepare", "--text", str(tmp_path / "text"), "--out", str(tmp_path / "data"), "--vocab", "300"])
    args = ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
            "--layers", "1", "--hidden", "128", "--q-lora-rank", "128", "--intermediate-size", "256", "--index-heads",
            "4", "--index-topk", "32", "--context", "128", "--batch", "1", "--long-context", "256", "--long-batch", "1",
            "--max-steps", "1", "--eval-contexts", "128,256", "--eval-windows", "1", "--kl-queries", "8",
            "--recall-queries", "4", "--prompts", "The", "--sample-tokens", "2", "--heldout-every", "1", "--device", "cpu"]
    run(args)
    record = json.loads((tmp_path / "out" / "train.json").read_text())
    assert record["command"].endswith("--device cpu")
    stages = ("dense", "long", "warmup", "sparse")
    assert [record["stages"][s]["steps"] for s in stages] == [1, 1, 1, 1]
    assert [record["stages"][s]["context"] for s in stages] == [128, 256, 256, 256]
    assert all("heldout" in record["stages"][s]["curve"][0] for s in stages)
    assert set(record["eval"]["sparse"]["256"]) >= {"dense", "sparse", "k", "mtp"}
    assert record["eval"]["sparse"]["256"]["k"] == 32 and record["config"]["num_nextn_predict_layers"] == 1
    assert 0 < record["recall"]["256"]["mean"]["recall"] <= 1.0 + 1e-6
    assert (tmp_path / "out" / "train_loss.png").exists() and (tmp_path / "out" / "model" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    refit = ["refit", "--from", str(tmp_path / "out" / "model"), "--data", str(tmp_path / "data"),
             "--out", str(tmp_path / "refit"), "--long-context", "256", "--long-batch", "1", "--max-steps", "1",
             "--eval-contexts", "128,256", "--eval-windows", "1", "--kl-queries", "8", "--recall-queries", "4",
             "--device", "cpu"]
    run(refit)  # more indexer warm-up for that export: before and after, only the indexers replaced
    refitted = json.loads((tmp_path / "refit" / "refit.json").read_text())
    assert set(refitted["recall"]) == {"before", "after"} and refitted["stages"]["warmup"]["steps"] == 1
    assert refitted["export"]["replaced"] > 0 and refitted["data"]["files"] == record["data"]["files"]
    resumed = run(args + ["--resume"])  # every stage done: straight to the export
    assert "resumed after ['dense', 'long', 'warmup', 'sparse']" in resumed.out
    assert json.loads((tmp_path / "out" / "train.json").read_text())["resumed_after"] == list(stages)
    with pytest.raises(SystemExit) as bad:  # the script exits with this line on stderr (and status 1)
        script.main(["train", "--data", str(tmp_path / "nowhere")])
    assert str(bad.value.code).startswith("--data: no data_manifest.json")


def test_script_warns_before_training_on_cpu(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "train_default", "train.py")
    done = subprocess.run([sys.executable, script, "train", "--data", str(tmp_path / "nowhere"), "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("train.py train: warning: training on cpu, not on the H200"), done.stderr
    assert done.returncode != 0 and lines[-1].startswith("--data: no data_manifest.json"), done.stderr
