"""Checkpoint loading: FP8 block weights, sharding, MTP layers, errors that name tensors, overrides."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsa import DSAModel
from dsa.loading import FP8_BLOCK, dequantize_fp8_block
from tests.model_utils import tiny_model

HF_CONFIG = dict(model_type="deepseek_v32", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128,
                 kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=16,
                 index_n_heads=4, index_head_dim=128, index_topk_pattern="FSFS", max_position_embeddings=16384,
                 rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                 block_size=16)


def _write(folder, tensors: dict, shards: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _hf_tensors(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        out[k if k == "lm_head.weight" else f"model.{k}"] = v.float().contiguous()
    return out


def _quantize_fp8_block(w: torch.Tensor):
    n, k = w.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK)
    padded[:n, :k] = w
    blocks = padded.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8) / 448  # [bn, bk]
    w8 = (blocks / scale[:, None, :, None]).view(bn * FP8_BLOCK, bk * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return w8, scale


@pytest.fixture(scope="module")
def source():
    return tiny_model(seed=3, block_size=16)


def test_fp8_block_checkpoint_equals_its_dequantized_twin(source, tmp_path):
    tensors = _hf_tensors(source)
    fp8, twin = {}, {}
    for k, v in tensors.items():
        if v.dim() == 2 and "proj" in k and v.shape[0] >= 64:  # linear weights, as DeepSeek ships them
            w8, scale = _quantize_fp8_block(v)
            fp8[k], fp8[k + "_scale_inv"] = w8, scale
            twin[k] = dequantize_fp8_block(w8, scale)
        else:
            fp8[k] = twin[k] = v
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 10
    _write(tmp_path / "fp8", fp8, shards=3)
    _write(tmp_path / "twin", twin)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    a = DSAModel.from_pretrained(tmp_path / "fp8", dtype=torch.float32, device="cpu", indexer_precision="exact")
    b = DSAModel.from_pretrained(tmp_path / "twin", dtype=torch.float32, device="cpu", indexer_precision="exact")
    assert torch.equal(a(ids), b(ids))


def test_round_trip_mtp_layer_skipped(source, tmp_path, caplog):
    tensors = _hf_tensors(source)
    tensors["model.layers.4.self_attn.q_a_proj.weight"] = torch.zeros(128, 256)  # an MTP / next-n layer
    _write(tmp_path, tensors)
    with caplog.at_level(logging.INFO, logger="dsa"):
        model = DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", indexer_precision="exact")
    assert "MTP" in caplog.text
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(model(ids), source(ids), atol=1e-5)


def test_missing_and_misshaped_tensors_are_named(source, tmp_path):
    tensors = _hf_tensors(source)
    del tensors["model.layers.2.self_attn.indexer.wk.weight"]
    _write(tmp_path / "missing", tensors)
    with pytest.raises(ValueError, match=r"layers\.2\.self_attn\.indexer\.wk\.weight"):
        DSAModel.from_pretrained(tmp_path / "missing", dtype=torch.float32, device="cpu")
    tensors = _hf_tensors(source)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(10, 512)
    _write(tmp_path / "shape", tensors)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.kv_b_proj\.weight: expected \[256, 512\], got \[10, 512\]"):
        DSAModel.from_pretrained(tmp_path / "shape", dtype=torch.float32, device="cpu")


def test_overrides(source, tmp_path):
    _write(tmp_path, _hf_tensors(source))
    m = DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", kv_cache_format="fp32", index_topk=8)
    assert m.config.index_topk == 8 and m.config.kv_cache_format == "fp32"
    with pytest.raises(ValueError, match="overrides"):
        DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", num_attention_heads=8)
    assert load_file(str(tmp_path / "model.safetensors"))  # the folder is untouched
