"""Selection quality against a teacher: indexer logits (exact and FP8), selections, attention-mass metrics,
the warm-up loss, and the fitted indexers' files.

Vocabulary: ``x [T, hidden]`` a layer's indexer input (its normed hidden state), ``probs [Q, T]`` the
layer's head-averaged attention of ``Q`` query positions ``queries [Q]`` (rows sum to 1, 0 past each
query), a selection ``[Q, K]`` int32 positions padded with -1 (what ``topk_indices`` returns).
"""
import json
import os

import torch

from dsa.config import DSAConfig, layer_runs_indexer
from dsa.indexer import LightningIndexer
from dsa.kernels import rope_at, topk_indices, yarn_cos_sin
from dsa.model.loading import SCALE_SUFFIX, dequantize_fp8_block, quantize_fp8_block
from dsa.quality.teacher import selection_mask

SINK = 4  # sink + recent keeps tokens 0..3 and the last k - 4
PACKAGED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "indexers", "smollm2")


# ---- the indexer attached to a teacher layer ------------------------------------------------
def indexer_config(teacher_config, heads: int, head_dim: int = 128) -> DSAConfig:
    """A DSAConfig whose indexer reads the teacher's hidden state directly (``q_lora_rank=None``: ``wq_b``
    reads ``x``), with NeoX RoPE on its first 64 dims at the teacher's ``rope_theta``."""
    c = teacher_config
    return DSAConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, q_lora_rank=None,
                     n_routed_experts=None, rope_theta=c.rope_theta, rope_scaling=None,
                     max_position_embeddings=c.context_length, index_n_heads=heads, index_head_dim=head_dim)


def rope_tables(config: DSAConfig, t: int, device):
    cos, sin = yarn_cos_sin(t, config.qk_rope_head_dim, config.rope_theta, None)
    return cos.to(device), sin.to(device)


def indexer_logits(indexer: LightningIndexer, x: torch.Tensor, queries: torch.Tensor, cos, sin,
                   precision: str) -> torch.Tensor:
    """``[Q, T]`` float32 logits of the query positions against keys ``0 .. T-1``, ``-inf`` past each
    query, by :meth:`LightningIndexer.score` (the model's scoring) on a teacher layer's normed input
    (no query latent: ``qr = x``). ``"exact"``: differentiable (fitting uses it); ``"fp8"``: the
    deployed path, on a bfloat16 indexer, without gradients."""
    rot = rope_at(torch.arange(x.shape[0], device=x.device), cos, sin)
    if precision != "fp8":
        return indexer.score(x, x, rot, queries, precision)
    if indexer.wq_b.weight.dtype != torch.bfloat16:
        raise TypeError(f"indexer: the fp8 path runs a bfloat16 indexer, got {indexer.wq_b.weight.dtype}")
    with torch.no_grad():
        x = x.to(torch.bfloat16)
        return indexer.score(x, x, rot, queries, "fp8")


def warmup_kl(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's dense warm-up loss, mean over rows: ``KL(probs || softmax(logits))`` over each
    row's valid keys (``logits`` ``-inf`` and ``probs`` 0 elsewhere)."""
    logq = torch.log_softmax(logits, dim=-1)
    inside = probs > 0
    kl = torch.where(inside, probs * (torch.log(torch.where(inside, probs, 1.0)) - torch.where(inside, logq, 0.0)), 0.0)
    return kl.sum(-1).mean()


def selected_set_kl(logits: torch.Tensor, probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's sparse-stage indexer loss, mean over rows: ``KL(probs' || softmax(logits'))`` over
    each row's selected keys only, both renormalized there (``logits [R, S]`` the indexer's, ``probs
    [R, S]`` the attention restricted to ``selected [R, S]`` bool, so its rows already sum to 1 over it).
    The sparse stage of the trained default (:mod:`dsa.quality.train`) trains on this."""
    return warmup_kl(logits.masked_fill(~selected, float("-inf")), probs)


def topk_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits``-shaped bool (``[..., S]``): each query's ``k`` best causal positions (all of them while
    they fit); ties at the k-th value go to the lowest positions, the inference top-k's rule."""
    idx = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(-1, idx, True)
    return mask & torch.isfinite(logits)


# ---- selections ----------------------------------------------------------------------------
def select(scores: torch.Tensor, queries: torch.Tensor, k: int) -> torch.Tensor:
    """``[Q, k]`` int32: the ``k`` best of ``scores[j, 0 : queries[j] + 1]`` (all of them when they fit), -1 padded."""
    return topk_indices(scores.float().contiguous(), (queries + 1).to(torch.int32), k)


def oracle(probs: torch.Tensor, queries: torch.Tensor, k: int, skip_first: bool = False) -> torch.Tensor:
    """The true top-k of the attention (the most mass any ``k`` positions can hold); with
    ``skip_first`` the best ``k`` among positions >= 1."""
    if skip_first:
        probs = probs.clone()
        probs[:, 0] = -1.0
    return select(probs, queries, k)


def sink_recent(queries: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens ``0 .. 3`` and the last ``k - 4`` positions up to each query (for queries past ``k``)."""
    recent = queries[:, None] - torch.arange(k - SINK, device=queries.device)[None, :]
    sink = torch.arange(SINK, device=queries.device).expand(len(queries), SINK)
    return torch.cat((sink, recent), dim=1).to(torch.int32)


def mass(probs: torch.Tensor, selected: torch.Tensor, skip_first: bool = False) -> torch.Tensor:
    """``[Q]`` the attention mass on each row's selection; with ``skip_first`` the share of the mass
    on positions >= 1 that the selection holds (token 0, the attention sink, left out of both)."""
    got = probs.gather(1, selected.long().clamp(min=0)).masked_fill(selected < 0, 0.0)
    if not skip_first:
        return got.sum(1)
    got = got.masked_fill(selected == 0, 0.0).sum(1)
    return got / probs[:, 1:].sum(1).clamp(min=1e-30)  # summed, not 1 - p0: p0 is often near 1


def agreement(selected: torch.Tensor, reference: torch.Tensor, t: int) -> torch.Tensor:
    """``[Q]`` |selected & reference| / |reference| per row (positions below ``t``)."""
    ref = selection_mask(reference, t)
    return (selection_mask(selected, t) & ref).sum(1) / ref.sum(1).clamp(min=1)


def hits(selected: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[Q]`` bool: is ``targets[j]`` among row ``j``'s selection."""
    return (selected == targets[:, None].to(selected.dtype)).any(1)


def reuse_source(fitted, every: int, num_layers: int | None = None) -> dict:
    """The skip pattern "every ``every`` layers": layer ``i`` runs its own indexer when DSA's skip
    predicate (``index_topk_freq=every``, ``index_skip_topk_offset=1``: layers 0, every, 2*every, ...)
    says so and ``i`` has a fitted one; any other layer reuses the selection of the nearest earlier
    layer that ran one. Returns ``{layer: source layer}`` for layers ``0 .. num_layers - 1`` (default:
    up to the last fitted one); layers before the first source are left out (they attend densely)."""
    fitted = set(fitted)
    n = max(fitted) + 1 if num_layers is None else num_layers
    cfg = DSAConfig(num_hidden_layers=n, index_topk_freq=every, index_skip_topk_offset=1)
    out, last = {}, None
    for i in range(n):
        if i in fitted and layer_runs_indexer(cfg, i):
            last = i
        if last is not None:
            out[i] = last
    return out


# ---- files: one safetensors per layer --------------------------------------------------------
def indexer_file(layer: int) -> str:
    return f"layer_{layer:02d}.safetensors"


FP8_WEIGHTS = ("wq_b.weight", "wk.weight")  # stored as FP8 blocks; weights_proj and k_norm in bf16, as in V3.2


def save_indexer(indexer: LightningIndexer, layer: int, out_dir: str, meta: dict) -> str:
    """``layer_XX.safetensors``: the indexer's state dict, ``wq_b`` and ``wk`` as FP8 e4m3 128 x 128 blocks
    with their ``weight_scale_inv`` (V3.2's checkpoint format, half the bytes of bf16), the rest in
    bfloat16; its shape in the metadata."""
    from safetensors.torch import save_file

    c = indexer.config
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, indexer_file(layer))
    tensors = {}
    for k, v in indexer.state_dict().items():
        v = v.detach().cpu()
        if k in FP8_WEIGHTS:
            tensors[k], tensors[k + SCALE_SUFFIX] = quantize_fp8_block(v)
        else:
            tensors[k] = v.to(torch.bfloat16).contiguous()
    info = {"layer": layer, "hidden_size": c.hidden_size, "index_n_heads": c.index_n_heads,
            "index_head_dim": c.index_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "rope_theta": c.rope_theta,
            "num_hidden_layers": c.num_hidden_layers, **meta}
    save_file(tensors, path, metadata={k: json.dumps(v) for k, v in info.items()})
    return path


def load_indexers(folder: str, teacher_config, device=None, dtype=torch.float32, layers=None) -> dict:
    """``{layer: LightningIndexer}`` from a folder of ``layer_XX.safetensors`` written by ``save_indexer``
    (FP8 block weights dequantized; files of bf16 weights load too)."""
    from safetensors import safe_open

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"indexers: no folder {folder} (run `dsa fit-indexer --out {folder}` first)")
    out = {}
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("layer_") and name.endswith(".safetensors")):
            continue
        with safe_open(os.path.join(folder, name), "pt") as f:
            meta = {k: json.loads(v) for k, v in f.metadata().items()}
            raw = {k: f.get_tensor(k) for k in f.keys()}
        state = {k: dequantize_fp8_block(v, raw[k + SCALE_SUFFIX]) if k + SCALE_SUFFIX in raw else v
                 for k, v in raw.items() if not k.endswith(SCALE_SUFFIX)}  # FP8 blocks, or bf16 files as before
        layer = int(meta["layer"])
        if layers is not None and layer not in layers:
            continue
        if meta["hidden_size"] != teacher_config.hidden_size or layer >= teacher_config.num_layers:
            raise ValueError(f"indexers: {name} was fitted for hidden size {meta['hidden_size']}, layer {layer}; "
                             f"the teacher has {teacher_config.hidden_size} and {teacher_config.num_layers} layers")
        idx = LightningIndexer(indexer_config(teacher_config, meta["index_n_heads"], meta["index_head_dim"]))
        idx.load_state_dict({k: v.float() for k, v in state.items()})
        out[layer] = idx.to(device=device, dtype=dtype).requires_grad_(False)
    if not out:
        raise FileNotFoundError(f"indexers: no layer_XX.safetensors in {folder}")
    return out
