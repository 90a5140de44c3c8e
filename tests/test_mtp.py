"""The MTP module in the model: built, loaded (V3.2 names and our export), its caches counted, its step
path against the trainer's differentiable torch path (the reference)."""
import json
import logging

import pytest
import torch
from safetensors.torch import save_file

import dsa.quality.train as T
from dsa import DSAConfig, DSAModel
from dsa.config import bytes_per_token
from dsa.model.mtp import mtp_logits
from dsa.model.presets import DEFAULT_CHECKPOINT, default_model
from model_utils import tiny_model


def _ids(b: int, s: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    # dense MLP (the trainer's paths are dense), exact indexer, index_topk 16: the 40-token rows go sparse
    return tiny_model(seed=2, n_routed_experts=None, index_topk_pattern=None, num_nextn_predict_layers=1)


def test_random_builds_the_module_after_the_main_weights(model):
    plain = tiny_model(seed=2, n_routed_experts=None, index_topk_pattern=None)
    assert plain.mtp is None and model.mtp is not None and model.mtp.self_attn.runs_indexer
    same = {k: torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    assert all(same.values()), [k for k, ok in same.items() if not ok][:3]
    assert {"mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight", "mtp.shared_head.norm.weight",
            "mtp.self_attn.indexer.wk.weight", "mtp.mlp.gate_proj.weight"} <= set(model.state_dict())


@pytest.mark.parametrize("b,s", [(1, 40), (2, 23)], ids=["one-sparse", "two-dense"])
def test_step_path_matches_the_trainers_torch_path(model, b, s):
    ids = _ids(b, s, seed=s)
    got, hidden = mtp_logits(model, ids)
    with torch.no_grad():
        _, _, ref = T.run_with_mtp(model, model.mtp, ids, "sparse")
    assert got.shape == ref.shape == (b, s - 1, 512) and hidden.shape == (b, s - 1, 256)
    err = (got - ref).abs().max()
    assert err < 1e-4, f"max |step - reference| = {err:.3g} (logits up to {ref.abs().max():.3g})"


def test_caches_and_bytes_count_the_mtp_layer(model):
    c = model.config
    assert bytes_per_token(c, model.dtype, mtp=True) - bytes_per_token(c, model.dtype) == 576 * 4 + 128 * 4
    caches = model.allocate_caches(3, mtp=True)
    assert len(caches.latent) == c.num_hidden_layers + 1 and caches.index[-1] is not None
    assert len(model.allocate_caches(3).latent) == c.num_hidden_layers
    with pytest.raises(ValueError, match="mtp"):
        tiny_model().allocate_caches(3, mtp=True)
    v32 = DSAConfig.deepseek_v32()
    assert (bytes_per_token(v32), bytes_per_token(v32, mtp=True)) == (78324, 79608)


def _checkpoint(model, folder, extra: dict | None = None) -> None:
    """``model`` in the V3.2 layout: ``model.*``, ``lm_head``, the MTP module as ``model.layers.{n}.*``."""
    n = model.config.num_hidden_layers
    tensors = {}
    for k, v in model.state_dict().items():
        name = k if k == "lm_head.weight" else f"model.layers.{n}.{k[4:]}" if k.startswith("mtp.") else f"model.{k}"
        tensors[name] = v.contiguous()
    folder.mkdir()
    save_file({**tensors, **(extra or {})}, str(folder / "model.safetensors"))
    cfg = dict(model_type="deepseek_v32", vocab_size=512, hidden_size=256, intermediate_size=512,
               num_hidden_layers=n, num_attention_heads=4, q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32,
               n_routed_experts=None, index_topk=16, index_n_heads=4, max_position_embeddings=16384,
               rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
               num_nextn_predict_layers=1, block_size=16)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_v32_names_load_with_the_shared_copies_skipped(model, tmp_path, caplog):
    n = model.config.num_hidden_layers
    shared = {f"model.layers.{n}.embed_tokens.weight": model.embed_tokens.weight.clone(),
              f"model.layers.{n}.shared_head.head.weight": model.lm_head.weight.clone()}
    _checkpoint(model, tmp_path / "ckpt", shared)
    with caplog.at_level(logging.INFO, logger="dsa"):
        back = DSAModel.from_pretrained(tmp_path / "ckpt", dtype=torch.float32, device="cpu",
                                        indexer_precision="exact")
    assert back.mtp is not None
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids = _ids(1, 30, seed=5)
    assert torch.equal(mtp_logits(back, ids)[0], mtp_logits(model, ids)[0])


def test_default_checkpoint_carries_the_trained_module():
    m = default_model("cpu")
    assert m.mtp is not None and m.mtp.self_attn.runs_indexer and not hasattr(m.mtp.mlp, "gate")
    ref, mtp = T.import_export(DEFAULT_CHECKPOINT, "cpu")  # the trainer's import of the same export
    ours = m.mtp.state_dict()
    for k, v in mtp.state_dict().items():
        torch.testing.assert_close(ours[k].float(), v.float(), msg=k)


def test_mtp_step_refuses_a_model_without_one():
    with pytest.raises(ValueError, match="MTP"):
        mtp_logits(tiny_model(), _ids(1, 8))
