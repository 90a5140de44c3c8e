"""DSAConfig presets, from_hf_config, the layer-skip predicate, cache arithmetic, softmax scale."""
import json

import pytest
import torch

import dsa
from dsa import DSAConfig, bytes_per_token, layer_runs_indexer
from dsa.config import indexer_layers, softmax_scale


def test_glm_5_2_skip_table():
    cfg = DSAConfig.glm_5_2_skip()
    runs = indexer_layers(cfg)
    assert runs == [0, 1, 2] + list(range(6, 75, 4))
    assert len(runs) == 21 and cfg.num_hidden_layers == 78
    assert runs[-1] == 74


def test_v32_runs_everywhere():
    cfg = DSAConfig.deepseek_v32()
    assert indexer_layers(cfg) == list(range(61))
    assert bytes_per_token(cfg) == 61 * 1152 + 61 * 132 == 78324


def test_pattern_wins_over_freq_and_types_win_over_both():
    base = DSAConfig.tiny(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=1)
    assert [layer_runs_indexer(base, i) for i in range(6)] == [True, False, True, False, True, False]
    pat = base.replace(index_topk_pattern="FFSSFS")
    assert [layer_runs_indexer(pat, i) for i in range(6)] == [True, True, False, False, True, False]
    types = pat.replace(indexer_types=("full", "shared", "shared", "full", "full", "full"))
    assert [layer_runs_indexer(types, i) for i in range(6)] == [True, False, False, True, True, True]


@pytest.mark.parametrize("kw", [dict(index_topk_pattern="SFFF"), dict(indexer_types=("shared", "full", "full", "full")),
                                dict(index_topk_freq=2, index_skip_topk_offset=0)], ids=["pattern", "types", "freq"])
def test_layer_zero_shared_is_rejected(kw):
    with pytest.raises(ValueError, match="layer 0"):
        DSAConfig.tiny(**kw)


def test_no_indexer_model():
    cfg = DSAConfig.tiny(index_topk=None)
    assert not any(layer_runs_indexer(cfg, i) for i in range(cfg.num_hidden_layers))
    assert bytes_per_token(cfg) == 4 * 1152
    assert bytes_per_token(cfg, torch.float32) == 4 * 2304


def test_bytes_per_token_formats():
    cfg = DSAConfig.glm_5_2_skip()
    assert bytes_per_token(cfg) == 78 * 1152 + 21 * 132
    assert bytes_per_token(cfg.replace(kv_cache_format="fp8")) == 78 * 656 + 21 * 132
    assert bytes_per_token(cfg.replace(indexer_precision="exact"), torch.float32) == 78 * 2304 + 21 * 512


def test_softmax_scale_v32_yarn():
    assert softmax_scale(DSAConfig.deepseek_v32()) == pytest.approx(0.135234, abs=5e-7)
    assert softmax_scale(DSAConfig.tiny(rope_scaling=None)) == pytest.approx((32 + 64) ** -0.5)
    assert softmax_scale(DSAConfig.glm_5_2_skip()) == pytest.approx(256 ** -0.5)


def test_presets_are_complete():
    v32 = DSAConfig.deepseek_v32()
    assert (v32.num_hidden_layers, v32.hidden_size, v32.num_attention_heads, v32.q_lora_rank, v32.vocab_size,
            v32.n_routed_experts, v32.num_experts_per_tok, v32.first_k_dense_replace) == (61, 7168, 128, 1536, 129280,
                                                                                          256, 8, 3)
    glm = DSAConfig.glm_5_2_skip()
    assert (glm.hidden_size, glm.num_attention_heads, glm.q_lora_rank, glm.qk_nope_head_dim, glm.v_head_dim,
            glm.index_n_heads, glm.indexer_rope_interleave, glm.rms_norm_eps) == (6144, 64, 2048, 192, 256, 32, True,
                                                                                  1e-5)
    tiny = DSAConfig.tiny()
    assert tiny.kv_lora_rank + tiny.qk_rope_head_dim == 576 and tiny.index_head_dim == 128
    with pytest.raises(Exception):
        tiny.hidden_size = 3  # frozen


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="kv_cache_format"):
        DSAConfig.tiny(kv_cache_format="int4")
    with pytest.raises(ValueError, match="indexer_precision"):
        DSAConfig.tiny(indexer_precision="fp4")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DSAConfig.tiny(kv_lora_rank=256)


V32_JSON = {
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_key_value_heads": 128, "torch_dtype": "bfloat16",
}

GLM_JSON = {
    "model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78, "num_attention_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_topk": 2048, "index_topk_freq": 4, "index_skip_topk_offset": 3, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}


def test_from_hf_config_v32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V32_JSON))
    cfg = DSAConfig.from_hf_config(tmp_path)
    assert cfg.rope_scaling["factor"] == 40 and not cfg.indexer_rope_interleave
    assert softmax_scale(cfg) == pytest.approx(0.135234, abs=5e-7)
    assert len(indexer_layers(cfg)) == 61
    assert DSAConfig.from_hf_config(tmp_path / "config.json") == cfg


def test_from_hf_config_glm():
    cfg = DSAConfig.from_hf_config(GLM_JSON)
    assert cfg.indexer_rope_interleave and cfg.index_n_heads == 32 and cfg.rope_theta == 1e6
    assert cfg.rope_scaling is None
    assert len(indexer_layers(cfg)) == 21
    explicit = DSAConfig.from_hf_config({**GLM_JSON, "indexer_rope_interleave": False})
    assert not explicit.indexer_rope_interleave
    types = ["full", "full", "shared"] * 26
    cfg = DSAConfig.from_hf_config({**GLM_JSON, "indexer_types": types})
    assert indexer_layers(cfg) == [i for i in range(78) if i % 3 != 2]


def test_from_hf_config_v3_has_no_indexer():
    cfg = DSAConfig.from_hf_config({**V32_JSON, "model_type": "deepseek_v3"})
    assert cfg.index_topk is None and indexer_layers(cfg) == []
    with pytest.raises(ValueError, match="model_type"):
        DSAConfig.from_hf_config({**V32_JSON, "model_type": "llama"})


def test_lazy_exports():
    assert dsa.layer_runs_indexer is layer_runs_indexer
    from dsa.indexer import layer_runs_indexer as again
    assert again is layer_runs_indexer


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("fmt,precision,dtype", [("bf16", "fp8", torch.bfloat16), ("fp8", "fp8", torch.bfloat16),
                                                 ("auto", "exact", torch.float32), ("auto", "fp8", torch.float32)],
                         ids=["bf16-fp8", "fp8-fp8", "fp32-exact", "fp32-fp8"])
def test_bytes_per_token_is_what_the_caches_allocate(head_dim, fmt, precision, dtype):
    cfg = DSAConfig.tiny(index_head_dim=head_dim, kv_cache_format=fmt, indexer_precision=precision,
                         index_topk_pattern="FSFF")
    model = dsa.DSAModel.random(cfg, dtype=dtype, device="cpu")
    caches = model.allocate_caches(3)
    allocated = sum(c.data.nbytes for layer in caches for c in layer if c is not None) // (3 * cfg.block_size)
    assert bytes_per_token(cfg, dtype) == allocated


BAD_CONFIGS = [  # (field named by the error, error type, overrides)
    ("num_experts_per_tok", ValueError, dict(num_experts_per_tok=5)),
    ("n_group", ValueError, dict(n_group=3)),
    ("topk_group", ValueError, dict(n_group=2, topk_group=3)),
    ("num_experts_per_tok", ValueError, dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3)),
    ("n_group", ValueError, dict(n_group=4, topk_group=2)),  # one expert a group: no top-2 group score
    ("moe_layer_freq", ValueError, dict(moe_layer_freq=0)),
    ("num_hidden_layers", TypeError, dict(num_hidden_layers=True)),
    ("hidden_size", TypeError, dict(hidden_size=256.0)),
    ("block_size", TypeError, dict(block_size=16.5)),
    ("index_topk", ValueError, dict(index_topk=0)),
    ("rope_theta", ValueError, dict(rope_theta=0.0, rope_scaling=None)),
    ("rope_theta", ValueError, dict(rope_theta=-1.0)),
    ("rope_scaling['factor']", ValueError, dict(rope_scaling={"type": "yarn", "factor": 0.0,
                                                              "original_max_position_embeddings": 4096})),
]


@pytest.mark.parametrize("field,exc,kw", BAD_CONFIGS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CONFIGS)])
def test_bad_configs_are_refused_by_field(field, exc, kw):
    with pytest.raises(exc, match="^" + field.replace("[", r"\[").replace("]", r"\]")):
        DSAConfig.tiny(**kw)


def test_config_file_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**V32_JSON, "num_experts_per_tok": 300}))
    with pytest.raises(ValueError, match=r"config\.json: num_experts_per_tok"):
        DSAConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**V32_JSON, "rope_scaling": "yarn"}))
    with pytest.raises(TypeError, match=r"config\.json: rope_scaling"):
        DSAConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json: not a valid JSON file"):
        DSAConfig.from_hf_config(tmp_path)
