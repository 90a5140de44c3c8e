"""Interop with an implementation nobody here wrote: transformers' DeepseekV32 and GlmMoeDsa models.

Tiny random HF models saved with ``save_pretrained`` load into DSAModel and give the same logits:
float32 + exact indexer on sequences longer than ``index_topk`` (the sparse regime), and bf16 on
sequences within it (dense; any indexer precision). transformers runs with our top-k tie rule
(ties at the k-th value go to the lowest positions), which its own ``torch.topk`` leaves open.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
    pytest.skip(f"needs transformers >= 5.24, found {transformers.__version__}", allow_module_level=True)

from dsa import DSAModel  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
              topk_group=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
              index_topk=16, index_n_heads=4, first_k_dense_replace=1, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _save(kind: str, path, **overrides) -> None:
    torch.manual_seed(0)
    if kind == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(**{**COMMON, "rope_parameters": YARN, **overrides})
        model = transformers.DeepseekV32ForCausalLM(cfg)
    else:  # GLM-MoE-DSA with a skip pattern: layer 2 reuses layer 1's top-k
        model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(
            **{**COMMON, "index_topk_pattern": "FFSF", **overrides}))
    with torch.no_grad():  # wider than HF's 0.02 init, so the layers do not all look alike
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path)


def _lowest_first_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` whose ties go to the lowest indices: our top-k rule. transformers' indexer
    calls ``topk`` on rows where the k-th value is often tied (ReLU zeros), and which tied positions
    ``torch.topk`` keeps depends on the row's width; with this rule both sides compute one function."""
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def _hf_logits(path, ids, dtype, monkeypatch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", _lowest_first_topk)
        return hf(ids).logits.float()


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(0, -2).double(), b.flatten(0, -2).double(), dim=-1)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_float32_exact_beyond_index_topk(kind, tmp_path, monkeypatch):
    _save(kind, tmp_path)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(tmp_path, ids, torch.float32, monkeypatch)
    model = DSAModel.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", indexer_precision="exact")
    got = model(ids)
    assert model.config.model_type == kind
    assert _cos(got, ref).mean() >= 0.999
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.97


@pytest.mark.parametrize("precision", ["fp8", "exact"])
@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_bf16_within_index_topk(kind, precision, tmp_path, monkeypatch):
    # every expert active: bf16 rounding then cannot flip a routing choice (the fp32 test covers routing)
    _save(kind, tmp_path, num_experts_per_tok=4)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = _hf_logits(tmp_path, ids, torch.bfloat16, monkeypatch)
    model = DSAModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu", indexer_precision=precision)
    assert _cos(model(ids), ref).min() >= 0.995
