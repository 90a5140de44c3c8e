"""Load HF checkpoint folders (``config.json`` + safetensors, sharded or not) into a DSAModel.

Tensor names are HF's with the ``model.`` prefix dropped. FP8 weights with ``weight_scale_inv``
(one fp32 scale per 128x128 block) are dequantized: ``W = W8 * scale_inv[i // 128, j // 128]``.
MTP / next-n layers (``layer >= num_hidden_layers``) are skipped with a log line.
"""
import json
import logging
import os
import re

import torch
from safetensors import safe_open

from .config import DSAConfig
from .model import param_dtype

log = logging.getLogger("dsa")

# DSAConfig fields that change which tensors exist or their shapes: not overridable at load
SHAPE_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "index_n_heads",
    "index_head_dim", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types",
    "tie_word_embeddings", "attention_bias"})
FP8_BLOCK = 128
LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _shards(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def dequantize_fp8_block(w8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``W8 [N, K] e4m3`` times its per-128x128-block ``scale_inv [ceil(N/128), ceil(K/128)]`` -> fp32."""
    n, k = w8.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return w8.float() * s


def read_checkpoint(path: str, num_layers: int) -> dict:
    """All tensors of a checkpoint folder by our names, FP8 blocks dequantized to fp32, MTP layers dropped."""
    raw, skipped = {}, set()
    for file in _shards(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                m = LAYER_RE.match(key)
                if m and int(m.group(1)) >= num_layers:
                    skipped.add(int(m.group(1)))
                    continue
                raw[key.removeprefix("model.")] = f.get_tensor(key)
    if skipped:
        log.info("skipping MTP / next-n layers %s (layer >= num_hidden_layers = %d)", sorted(skipped), num_layers)
    out = {}
    for key, t in raw.items():
        if key.endswith("_scale_inv"):
            continue
        scale = raw.get(key + "_scale_inv")
        if t.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise ValueError(f"{key}: an FP8 weight without its {key}_scale_inv")
            t = dequantize_fp8_block(t, scale)
        out[key] = t
    return out


def load_pretrained(cls, path, dtype: torch.dtype, device: torch.device, overrides: dict):
    path = os.fspath(path)
    bad = sorted(set(overrides) & SHAPE_FIELDS)
    if bad or ("index_topk" in overrides and overrides["index_topk"] is None):
        raise ValueError(f"overrides: {bad or ['index_topk=None']} would change the checkpoint's weights; "
                         "only fields that keep weight shapes can be overridden")
    config = DSAConfig.from_hf_config(path, **overrides)
    with torch.device("meta"):
        model = cls(config)
    expected = model.state_dict()
    tensors = read_checkpoint(path, config.num_hidden_layers)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {path}: missing tensors {missing[:8]}{more}")
    wrong = [f"{k}: expected {list(v.shape)}, got {list(tensors[k].shape)}" for k, v in expected.items()
             if tuple(tensors[k].shape) != tuple(v.shape)]
    if wrong:
        raise ValueError(f"checkpoint {path}: mis-shaped tensors: " + "; ".join(wrong[:8]))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        log.info("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(extra), extra[:3])
    model.load_state_dict({k: tensors[k].to(param_dtype(k, dtype)) for k in expected}, strict=True, assign=True)
    return model.finalize(dtype, device)
