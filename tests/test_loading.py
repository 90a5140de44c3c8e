"""Checkpoint loading: FP8 block weights, sharding, MTP layers, errors that name tensors, overrides."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsa import DSAConfig, DSAModel
from dsa.model.loading import FP8_BLOCK, dequantize_fp8_block
from model_utils import tiny_model

HF_CONFIG = dict(model_type="deepseek_v32", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128,
                 kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=16,
                 index_n_heads=4, index_head_dim=128, index_topk_pattern="FSFS", max_position_embeddings=16384,
                 rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                 num_nextn_predict_layers=1, block_size=16)


def _write(folder, tensors: dict, shards: int = 1, **config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, **config}))
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


def test_partial_mtp_layer_is_refused_by_name(source, tmp_path):
    tensors = _hf_tensors(source)
    tensors["model.layers.4.self_attn.q_a_proj.weight"] = torch.zeros(128, 256)  # an MTP layer, incomplete
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(256, 512)
    _write(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensors \['mtp\."):
        DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", indexer_precision="exact")


def test_config_without_mtp_tensors_loads_without_the_module(source, tmp_path, caplog):
    _write(tmp_path, _hf_tensors(source))  # num_nextn_predict_layers = 1, no layer 4
    with caplog.at_level(logging.INFO, logger="dsa"):
        model = DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", indexer_precision="exact")
    assert model.mtp is None and model.config.num_nextn_predict_layers == 0 and "no MTP layer" in caplog.text
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


# ---- checkpoints that cannot load faithfully are refused, naming the file and the tensor or field

def _fp8(tensors: dict, key: str) -> dict:
    w8, scale = _quantize_fp8_block(tensors[key])
    return {**tensors, key: w8, key + "_scale_inv": scale}


Q_A = "model.layers.1.self_attn.q_a_proj.weight"  # [128, 256]: a 1 x 2 grid of 128 x 128 scale blocks


def _case_num_hidden_layers_lowered_by_one(t):  # layer 3 would pass for the MTP layer but has no eh_proj
    return t, dict(num_hidden_layers=3), r"model\.safetensors: layers\.3: a decoder layer past num_hidden_layers = 3"


def _case_num_hidden_layers_lowered_by_two(t):
    return t, dict(num_hidden_layers=2), r"model\.safetensors: model\.layers\.3\..*num_hidden_layers = 2"


def _case_layer_past_mtp(t):
    return {**t, "model.layers.5.mlp.gate_proj.weight": torch.zeros(4, 4)}, {}, r"layers\.5\.mlp.*num_nextn"


def _case_indexer_for_v3(t):
    return t, dict(model_type="deepseek_v3"), r"model\.safetensors: layers\.0\.self_attn\.indexer\..*deepseek_v3"


def _case_oversized_scale(t):
    t = _fp8(t, Q_A)
    t[Q_A + "_scale_inv"] = torch.ones(2, 3)
    return t, {}, r"model\.safetensors: layers\.1\.self_attn\.q_a_proj\.weight_scale_inv: expected \[1, 2\]"


def _case_orphan_scale(t):
    return {**t, Q_A + "_scale_inv": torch.ones(1, 2)}, {}, r"q_a_proj\.weight_scale_inv: a block scale without"


def _case_nan_weight(t):
    t = dict(t)
    t["model.layers.2.mlp.experts.1.up_proj.weight"] = t["model.layers.2.mlp.experts.1.up_proj.weight"].clone()
    t["model.layers.2.mlp.experts.1.up_proj.weight"][3, 4] = float("nan")
    return t, {}, r"model\.safetensors: layers\.2\.mlp\.experts\.1\.up_proj\.weight: holds NaN or inf"


def _case_inf_scale(t):
    t = _fp8(t, Q_A)
    t[Q_A + "_scale_inv"][0, 1] = float("inf")
    return t, {}, r"q_a_proj\.weight_scale_inv: holds NaN or inf"


def _case_nan_fp8_weight(t):
    t = _fp8(t, Q_A)
    t[Q_A].view(torch.uint8)[5, 6] = 0xFF
    return t, {}, r"q_a_proj\.weight: holds NaN or inf"


def _case_too_many_experts_per_token(t):
    return t, dict(num_experts_per_tok=5), r"config\.json: num_experts_per_tok: expected <= 4"


def _case_n_group_not_dividing(t):
    return t, dict(n_group=3), r"config\.json: n_group: expected a divisor of n_routed_experts = 4"


def _case_topk_group_over_n_group(t):
    return t, dict(n_group=2, topk_group=3), r"config\.json: topk_group: expected <= n_group = 2"


def _case_bool_layers(t):
    return t, dict(num_hidden_layers=True), r"config\.json: num_hidden_layers: expected an int, got bool"


def _case_zero_rope_theta(t):
    return t, dict(rope_theta=0, rope_scaling=None), r"config\.json: rope_theta: expected a finite number > 0"


CHECKPOINT_FAULTS = [_case_num_hidden_layers_lowered_by_one, _case_num_hidden_layers_lowered_by_two, _case_layer_past_mtp, _case_indexer_for_v3, _case_oversized_scale,
                     _case_orphan_scale, _case_nan_weight, _case_inf_scale, _case_nan_fp8_weight,
                     _case_too_many_experts_per_token, _case_n_group_not_dividing, _case_topk_group_over_n_group,
                     _case_bool_layers, _case_zero_rope_theta]


@pytest.mark.parametrize("case", CHECKPOINT_FAULTS, ids=[c.__name__.removeprefix("_case_") for c in CHECKPOINT_FAULTS])
def test_checkpoint_faults_are_refused_by_name(source, tmp_path, case):
    tensors, config, message = case(_hf_tensors(source))
    _write(tmp_path, tensors, **config)
    with pytest.raises((ValueError, TypeError), match=message):
        DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_safetensors_file_is_named(source, tmp_path, damage):
    _write(tmp_path, _hf_tensors(source), shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: not a readable safetensors file"):
        DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""], ids=["syntax", "list", "empty"])
def test_invalid_config_json_is_named(source, tmp_path, text):
    _write(tmp_path, _hf_tensors(source))
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json: "):
        DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"config\.json: "):
        DSAConfig.from_hf_config(tmp_path)


def test_meta_construction_skips_only_the_init_calls():
    """``_SkipInit`` (the meta-device build of from_pretrained): torch.nn.init's dispatching initializers
    leave their tensor as it is, every other op runs, and the mode is gone after its block."""
    from torch import nn

    from dsa.model.model import _SkipInit
    t = torch.zeros(4, 3)
    with _SkipInit():
        for init in (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_):
            assert init(t) is t
        assert nn.init.constant_(t, 2.0) is t and torch.equal(t, torch.zeros(4, 3))
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))
        with torch.device("meta"):
            layer = nn.Linear(3, 4)
        assert layer.weight.is_meta
    assert nn.init.constant_(t, 2.0) is t and torch.equal(t, torch.full((4, 3), 2.0))
