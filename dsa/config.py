"""DSAConfig, the layer-skip predicate and the cache arithmetic.

A leaf of ``dsa``: imports torch and, from ``dsa.kernels``, only the validation helpers, the RoPE
table (which owns its constraints) and the byte layouts. Field names are the HF ``config.json`` keys
where one exists. A config that cannot describe a model (a non-int size, inconsistent MoE routing, an
unusable RoPE) is refused when it is built; from a file, the error names the file.
"""
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import torch

from dsa.kernels.common import check_int
from dsa.kernels.layouts import indexer_bytes_per_token, latent_bytes_per_token
from dsa.kernels.rope import yarn_cos_sin

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
KV_CACHE_FORMATS = ("auto", "bf16", "fp8", "fp32")
INDEXER_PRECISIONS = ("fp8", "exact")

# int fields and their least value (None: the field may also be None)
INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "moe_intermediate_size": 1,
              "num_hidden_layers": 1, "num_attention_heads": 1, "q_lora_rank": None, "kv_lora_rank": 1,
              "qk_nope_head_dim": 1, "qk_rope_head_dim": 2, "v_head_dim": 1, "n_routed_experts": None,
              "n_shared_experts": 0, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
              "first_k_dense_replace": 0, "moe_layer_freq": 1, "max_position_embeddings": 1, "index_n_heads": 1,
              "index_head_dim": 1, "index_topk": None, "index_topk_freq": 1, "index_skip_topk_offset": 0,
              "num_nextn_predict_layers": 0, "block_size": 1}

V32_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class DSAConfig:
    """Shapes and options of a DeepSeek-V3.2-style model. ``index_topk=None``: no indexer (plain MLA)."""

    model_type: str = "deepseek_v32"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE (DeepSeek: sigmoid scores + e_score_correction_bias, group-limited routing)
    n_routed_experts: int | None = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default_factory=lambda: dict(V32_YARN))
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple | None = 1
    # Indexer (DSA)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int | None = 2048
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | None = None
    indexer_types: tuple | None = None
    # Multi-token prediction (DeepSeek-V3's MTP): next-n modules after the decoder layers (the model builds
    # the first one, layer ``num_hidden_layers`` of the checkpoint; the engine drafts with it)
    num_nextn_predict_layers: int = 0
    # Ours
    block_size: int = 64
    kv_cache_format: str = "auto"
    indexer_precision: str = "fp8"
    indexer_hadamard: bool = True
    indexer_rope_interleave: bool = False
    dispatch_thresholds: str | None = None

    def __post_init__(self):
        for name, minimum in INT_FIELDS.items():
            value = getattr(self, name)
            if value is not None or minimum is not None:
                check_int(name, value, minimum=1 if minimum is None else minimum)
        self._check_moe()
        yarn_cos_sin(1, self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)  # refuses unusable RoPE
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.kv_cache_format not in KV_CACHE_FORMATS:
            raise ValueError(f"kv_cache_format: expected one of {KV_CACHE_FORMATS}, got {self.kv_cache_format!r}")
        if self.indexer_precision not in INDEXER_PRECISIONS:
            raise ValueError(f"indexer_precision: expected one of {INDEXER_PRECISIONS}, got {self.indexer_precision!r}")
        if self.kv_lora_rank + self.qk_rope_head_dim != 576:
            raise ValueError("kv_lora_rank + qk_rope_head_dim: the latent cache row is 576 wide (512 + 64), got "
                             f"{self.kv_lora_rank} + {self.qk_rope_head_dim}")
        if self.index_topk is not None:
            if self.indexer_types is not None and len(self.indexer_types) < self.num_hidden_layers:
                raise ValueError(f"indexer_types: expected {self.num_hidden_layers} entries, got "
                                 f"{len(self.indexer_types)}")
            if self.index_topk_pattern is not None and len(self.index_topk_pattern) < self.num_hidden_layers:
                raise ValueError(f"index_topk_pattern: expected {self.num_hidden_layers} characters, got "
                                 f"{len(self.index_topk_pattern)}")
            layer_runs_indexer(self, 0)  # raises when layer 0 is marked shared

    def _check_moe(self):
        """Group-limited routing needs ``n_group | n_routed_experts``, ``topk_group <= n_group``, two
        experts per group (groups score by their top two) and ``num_experts_per_tok`` experts inside the
        ``topk_group`` groups kept."""
        experts = self.n_routed_experts
        if experts is None:
            return
        if experts % self.n_group:
            raise ValueError(f"n_group: expected a divisor of n_routed_experts = {experts}, got {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: expected <= n_group = {self.n_group}, got {self.topk_group}")
        per_group = experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group: groups are scored by their two best experts; {experts} experts in "
                             f"{self.n_group} groups leave {per_group} per group")
        reachable = experts if self.n_group == 1 else self.topk_group * per_group
        if self.num_experts_per_tok > reachable:
            raise ValueError(f"num_experts_per_tok: expected <= {reachable} (experts in the topk_group = "
                             f"{self.topk_group} groups kept of n_routed_experts = {experts}), got "
                             f"{self.num_experts_per_tok}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **changes) -> "DSAConfig":
        return dataclasses.replace(self, **changes)

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def deepseek_v32(cls, **overrides) -> "DSAConfig":
        """DeepSeek-V3.2(-Exp): 61 layers, 128 heads, YaRN x40, every layer runs the indexer."""
        return cls(**overrides)

    @classmethod
    def glm_5_2_skip(cls, **overrides) -> "DSAConfig":
        """GLM-MoE-DSA shapes with the IndexCache skip pattern: 21 of 78 layers run the indexer."""
        base = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
                    qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=202752, index_n_heads=32,
                    index_topk_freq=4, index_skip_topk_offset=3, indexer_rope_interleave=True)
        return cls(**{**base, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "DSAConfig":
        """A few layers and heads with the real 576-wide latent and 128-wide indexer keys (tests, demos)."""
        base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, qk_nope_head_dim=32,
                    v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                    first_k_dense_replace=1, max_position_embeddings=16384, index_n_heads=4, index_topk=64,
                    block_size=16)
        return cls(**{**base, **overrides})

    @classmethod
    def from_hf_config(cls, path_or_dict, **overrides) -> "DSAConfig":
        """Read a HF ``config.json`` (a folder, the file, or its dict) of model type
        ``deepseek_v32``, ``glm_moe_dsa`` or ``deepseek_v3``."""
        if isinstance(path_or_dict, dict):
            return cls._from_hf_dict(dict(path_or_dict), overrides)
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        hf = read_json_object(path, "a model config")
        try:
            return cls._from_hf_dict(hf, overrides)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{path}: {e}") from None

    @classmethod
    def _from_hf_dict(cls, hf: dict, overrides: dict) -> "DSAConfig":
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {model_type!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in hf.items() if k in names}
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise TypeError(f"rope_scaling: expected an object, got {type(rope).__name__}")
        if rope is not None:
            kind = rope.get("rope_type", rope.get("type", "default"))
            kw["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
            kw["rope_scaling"] = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        else:
            kw["rope_scaling"] = None
        if model_type == "deepseek_v3":
            kw["index_topk"] = None
        kw.setdefault("indexer_rope_interleave", model_type == "glm_moe_dsa")
        if kw.get("indexer_types") is not None:
            kw["indexer_types"] = tuple(kw["indexer_types"])
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        if model_type != "deepseek_v32":  # the dataclass defaults are V3.2's; others start from plain values
            kw.setdefault("index_n_heads", 32 if model_type == "glm_moe_dsa" else 64)
            kw.setdefault("n_group", 1)
            kw.setdefault("topk_group", 1)
        return cls(**{**kw, **overrides})


def read_json_object(file: str, what: str) -> dict:
    """A JSON object from ``file``; ``ValueError`` naming the file when it is not valid JSON or not an
    object (``what`` says what it should hold)."""
    with open(file) as f:
        try:
            data = json.load(f)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{file}: not a valid JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected {what} (a JSON object), got {type(data).__name__}")
    return data


def layer_runs_indexer(config: DSAConfig, layer_id: int) -> bool:
    """True when layer ``layer_id`` computes its own top-k; False when it reuses an earlier one's.

    vLLM's predicate: ``indexer_types[i] == "shared"`` skips, else ``index_topk_pattern[i] == "S"``
    skips, else ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0`` skips.
    A model without an indexer (``index_topk=None``) runs none. Layer 0 must compute.
    """
    if config.index_topk is None:
        return False
    if not 0 <= layer_id < config.num_hidden_layers:
        raise ValueError(f"layer_id: expected 0 <= layer_id < {config.num_hidden_layers}, got {layer_id}")
    if config.indexer_types is not None:
        skip = config.indexer_types[layer_id] == "shared"
    elif config.index_topk_pattern is not None:
        skip = config.index_topk_pattern[layer_id] == "S"
    else:
        skip = max(layer_id - config.index_skip_topk_offset + 1, 0) % config.index_topk_freq != 0
    if layer_id == 0 and skip:
        raise ValueError("indexer pattern: layer 0 must run the indexer (there is no earlier top-k to reuse)")
    return not skip


def indexer_layers(config: DSAConfig) -> list[int]:
    """The layers that run the indexer, in order."""
    return [i for i in range(config.num_hidden_layers) if layer_runs_indexer(config, i)]


def latent_format(config: DSAConfig, dtype: torch.dtype = torch.bfloat16) -> str:
    """The latent cache format: ``kv_cache_format``, or from the model dtype when ``"auto"``."""
    if config.kv_cache_format != "auto":
        return config.kv_cache_format
    return "fp32" if dtype in (torch.float32, torch.float64) else "bf16"


def bytes_per_token(config: DSAConfig, dtype: torch.dtype = torch.bfloat16, mtp: bool = False) -> int:
    """Cache bytes per token, all layers: latent rows plus indexer keys of the layers that index;
    with ``mtp`` (an engine that speculates) the MTP module's layer too: a latent row, and an
    indexer key when the model has an indexer.

    V3.2 with a bf16 latent cache: ``61 * 1152 + 61 * 132 = 78,324`` (``62 * 1152 + 62 * 132 =
    79,608`` with the MTP module). The row sizes come from ``dsa.kernels.layouts``, which the caches
    allocate by.
    """
    latent = latent_bytes_per_token(latent_format(config, dtype))
    if config.indexer_precision == "fp8":
        key = indexer_bytes_per_token(config.index_head_dim)
    else:
        key = config.index_head_dim * torch.empty((), dtype=dtype).element_size()
    extra = latent + (key if config.index_topk is not None else 0) if mtp else 0
    return config.num_hidden_layers * latent + len(indexer_layers(config)) * key + extra


def softmax_scale(config: DSAConfig) -> float:
    """``(D_NOPE + D_R) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = config.qk_head_dim ** -0.5
    rope = config.rope_scaling or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        factor, mscale_all_dim = float(rope["factor"]), float(rope.get("mscale_all_dim", 0.0))
        if factor > 1 and mscale_all_dim:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
    return scale
