"""Training a small DeepSeek-V3.2-architecture model from scratch: DeepSeek-V3.2's three stages, scaled down.

The model is a :class:`dsa.DSAModel` (MLA with the 576-wide latent, a lightning indexer per layer, dense
MLP); training runs its own modules through differentiable torch, since the kernels have no backward.
Each path computes what the inference path computes:

    dense:    MLA by the up-projected path of ``DSAAttention._mha`` (the prefill path): ``kv_b_proj`` on the
              normed latent, the RoPE'd ``k_pe`` shared by the heads, SDPA causal at ``softmax_scale``
              (the absorbed kernels compute the same function)
    indexer:  ``LightningIndexer.project``, then ``sum_h w[t, h] HI^-0.5 DI^-0.5 relu(q[t, h] . k[s])`` over
              ``s <= t``: the exact-precision logits (the FP8 + Hadamard path approximates them)
    sparse:   the same MLA with each query restricted to the top-k positions of its layer's indexer
              logits (every position while ``t < k``); a layer that skips its indexer reuses the last
              selection, as ``DSAAttention`` does

Stages (:func:`stage_loss`):

    dense  (a): LM loss, dense attention; the indexers get no gradient
    warmup (b): everything but the indexers frozen; each indexer trained on
                ``KL(head-averaged attention || softmax(indexer logits))`` over its query's causal keys
    sparse (c): attention on the top-k; each indexer trained on the KL over its selected set with its
                input detached (no indexer gradient reaches the model); the model on the LM loss

The multi-token-prediction module (:class:`MTP`, DeepSeek-V3's layout, one of them) trains beside the LM
loss in every stage that trains the model (``MTP_WEIGHT`` times its loss on the token after next): at
position ``i`` it projects ``[enorm(embed(t[i + 1])), hnorm(h[i])]`` (``h`` the main model's output after
its final norm, what vLLM and SGLang hand a draft model) through ``eh_proj``, runs one decoder layer (with
its own indexer) at position ``i``, and predicts ``t[i + 2]`` through its ``shared_head.norm`` and the
main model's ``lm_head``.

The KL terms use ``kl_rows`` query positions (every sequence of the batch at the same positions) to
bound the ``[B, Q, HI, S]`` temporaries. :func:`export` writes the V3.2 HF layout.
"""
import json
import os

import torch
import torch.nn.functional as F

from dsa.config import DSAConfig
from dsa.kernels.indexer_query_prep import weight_scale
from dsa.model.loading import FP8_BLOCK, quantize_fp8_block
from dsa.model.mtp import MTPLayer
from dsa.quality.selection import selected_set_kl, topk_mask, warmup_kl

STAGES = ("dense", "warmup", "sparse")
MTP_WEIGHT = 0.3  # DeepSeek-V3's MTP loss weight (its first 10T tokens)
LOGIT_CHUNK_ELEMS = 1 << 27  # [B, C, HI, S] elements per no-grad indexer chunk
BOS, EOS = "<|bos|>", "<|endoftext|>"  # ids 0 and 1 of the trained tokenizer (V3.2's ids)
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def model_config(vocab_size: int, layers: int, hidden: int, context: int, index_heads: int = 8,
                 index_topk: int | None = None, q_lora_rank: int | None = None,
                 intermediate_size: int | None = None) -> DSAConfig:
    """A small V3.2-shaped config: the real latent (512 + 64) and indexer key width (128), 64-wide heads
    (``hidden / 64`` of them), ``q_lora_rank`` (default ``hidden / 2``), a SwiGLU MLP of ``intermediate_size``
    (default ``8/3 hidden`` rounded to 64), plain RoPE up to ``context``, ``index_topk`` (default
    ``context / 16``); BOS 0, EOS 1."""
    if hidden % 64 or hidden < 128:
        raise ValueError(f"hidden: expected a multiple of 64 >= 128, got {hidden}")
    if context % 16 or context < 256:
        raise ValueError(f"context: expected a multiple of 16 >= 256, got {context}")
    return DSAConfig.deepseek_v32(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate_size or 64 * round(hidden * 8 / 3 / 64),
        num_hidden_layers=layers, num_attention_heads=hidden // 64, q_lora_rank=q_lora_rank or hidden // 2,
        qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=None, rope_scaling=None, max_position_embeddings=context,
        index_n_heads=index_heads, index_head_dim=128, index_topk=index_topk or context // 16, bos_token_id=0,
        eos_token_id=1)


def new_model(config: DSAConfig, seed: int, device):
    """A trainable fp32 :class:`DSAModel` with ``DSAModel.random``'s init (normal(0, 0.02), norms at 1)."""
    from dsa.model import DSAModel
    return DSAModel.random(config, seed=seed, dtype=torch.float32, device=device).train().requires_grad_(True)


class MTP(MTPLayer):
    """The trainer's MTP module: :class:`dsa.model.mtp.MTPLayer` itself (one home), a dense MLP, its own
    indexer when the model has one. Exported as ``model.layers.{num_hidden_layers}.*`` under its own names."""

    def __init__(self, config: DSAConfig):
        super().__init__(config, runs_indexer=config.index_topk is not None, moe=False)

    def export_names(self) -> dict:
        """``{our name: the V3.2 checkpoint's name without the model.layers.N. prefix}``: the same."""
        return {n: n for n in self.state_dict()}


def new_mtp(config: DSAConfig, seed: int, device) -> MTP:
    """A trainable fp32 :class:`MTP` with ``DSAModel.random``'s init (normal(0, 0.02), norms at 1)."""
    from dsa.model.model import init_random_
    with torch.device(device):
        mtp = MTP(config)
    return init_random_(mtp, torch.Generator(device=device).manual_seed(seed + 1)).train()


def _named(model, mtp=None):
    yield from model.named_parameters()
    if mtp is not None:
        yield from (("mtp." + n, p) for n, p in mtp.named_parameters())


def indexer_params(model, mtp=None) -> list:
    return [p for n, p in _named(model, mtp) if ".indexer." in n]


def model_params(model, mtp=None) -> list:
    return [p for n, p in _named(model, mtp) if ".indexer." not in n]


# ---- the differentiable paths -----------------------------------------------------------------
def mla(attn, q_nope, q_pe, kv_c, k_pe, b: int, s: int, mask=None) -> torch.Tensor:
    """``[B * S, hidden]``: MLA of ``B`` sequences of ``S`` tokens, causal, or on ``mask [B, S, S]``."""
    c, h = attn.config, attn.num_heads
    kv = F.linear(kv_c, attn.kv_b_proj.weight).view(b, s, h, -1)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe.view(b, s, 1, -1).expand(b, s, h, c.qk_rope_head_dim)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).view(b, s, h, -1)
    if v.shape[-1] != k.shape[-1]:  # equal head dims let SDPA pick a fused kernel
        v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.softmax_scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=attn.softmax_scale)
    return attn.o_proj(o[..., :c.v_head_dim].transpose(1, 2).reshape(b * s, -1))


@torch.no_grad()
def head_avg_probs(attn, q_nope, q_pe, kv_c, k_pe, b: int, s: int, rows: torch.Tensor, allowed=None):
    """``[B, Q, S]`` fp32: the attention of query positions ``rows`` averaged over heads (causal, or on
    ``allowed [B, Q, S]``); rows sum to 1."""
    c, h = attn.config, attn.num_heads
    k_nope = F.linear(kv_c, attn.kv_b_proj.weight).view(b, s, h, -1)[..., :c.qk_nope_head_dim]
    k = torch.cat((k_nope, k_pe.view(b, s, 1, -1).expand(b, s, h, c.qk_rope_head_dim)), dim=-1).float()
    q = torch.cat((q_nope, q_pe), dim=-1).view(b, s, h, -1)[:, rows].float()
    scores = torch.einsum("bqhd,bshd->bhqs", q, k) * attn.softmax_scale
    keep = torch.arange(s, device=q.device)[None, :] <= rows[:, None]
    keep = keep[None] if allowed is None else keep[None] & allowed
    return torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1).mean(1)


def indexer_logits(indexer, x, qr, rot, b: int, s: int, rows=None) -> torch.Tensor:
    """``[B, Q, S]`` fp32 exact-precision logits of query positions ``rows`` (default: all), ``-inf``
    past each query; chunked over the queries when no gradient is recorded."""
    c = indexer.config
    q, k, w = indexer.project(x, qr, rot)
    q, k = q.view(b, s, c.index_n_heads, -1), k.view(b, s, -1)
    w = w.view(b, s, -1) * weight_scale(c.index_n_heads, c.index_head_dim)
    rows = torch.arange(s, device=x.device) if rows is None else rows
    q, w = q[:, rows], w[:, rows]
    step = len(rows) if torch.is_grad_enabled() else max(1, LOGIT_CHUNK_ELEMS // (b * c.index_n_heads * s))
    cols = torch.arange(s, device=x.device)
    out = []
    for r0 in range(0, len(rows), step):
        r1 = r0 + step
        score = torch.einsum("bqh,bqhs->bqs", w[:, r0:r1].to(q.dtype),
                             torch.relu(torch.einsum("bqhd,bsd->bqhs", q[:, r0:r1], k))).float()
        out.append(score.masked_fill(cols[None, None, :] > rows[None, r0:r1, None], float("-inf")))
    return torch.cat(out, dim=1)


def _layer(layer, x, rot, b: int, s: int, mode: str, topk: int, kl_rows, selected, observe=None, i=None):
    """One decoder layer of the differentiable paths: ``(x, selected, kl or None)``."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    qr, *parts = attn.project(h, rot)  # q_nope, q_pe, kv_c, k_pe
    parts[0] = parts[0].view(b, s, attn.num_heads, -1)
    parts[1] = parts[1].reshape(b, s, attn.num_heads, -1)
    if observe is not None:
        observe(i, attn, h, qr, parts, rot)
    kl = None
    if mode != "dense" and attn.indexer is not None:
        if mode == "sparse":
            with torch.no_grad():
                selected = topk_mask(indexer_logits(attn.indexer, h, qr, rot, b, s), topk)
        if kl_rows is not None:
            logits = indexer_logits(attn.indexer, h.detach(), qr.detach(), rot, b, s, kl_rows)
            if mode == "warmup":
                kl = warmup_kl(logits.flatten(0, 1), head_avg_probs(attn, *parts, b, s, kl_rows).flatten(0, 1))
            else:
                allowed = selected[:, kl_rows]
                probs = head_avg_probs(attn, *parts, b, s, kl_rows, allowed)
                kl = selected_set_kl(logits.flatten(0, 1), probs.flatten(0, 1), allowed.flatten(0, 1))
    x = x + mla(attn, *parts, b, s, selected if mode == "sparse" else None)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, selected, kl


def run(model, ids: torch.Tensor, mode: str, topk: int | None = None, kl_rows=None, observe=None):
    """``(logits [B, S, vocab] fp32, [KL per indexer layer])`` for ``ids [B, S]``.

    ``mode``: ``"dense"`` (no indexer), ``"warmup"`` (dense attention, KL to the full attention) or
    ``"sparse"`` (attention on each query's top-``topk``, default ``config.index_topk``; KL on the
    selected set). The KL terms (rows ``kl_rows``, none when None) read the indexer input detached.
    ``observe(layer_id, attn, h, qr, parts, rot)`` sees each layer's attention input and projections.
    """
    logits, kls, _ = run_with_mtp(model, None, ids, mode, topk, kl_rows, observe)
    return logits, kls


def run_with_mtp(model, mtp, ids: torch.Tensor, mode: str, topk: int | None = None, kl_rows=None, observe=None):
    """:func:`run` plus the MTP module's ``[B, S - 1, vocab]`` fp32 logits (row ``i`` predicts ``ids[:, i + 2]``;
    None without ``mtp``); its indexer's KL (if any) is the last of the list."""
    if mode not in STAGES:
        raise ValueError(f"mode: expected one of {STAGES}, got {mode!r}")
    b, s = ids.shape
    topk = topk or model.config.index_topk
    rot = model.rope_at(torch.arange(s, device=ids.device)).repeat(b, 1)
    x = model.embed_tokens(ids).view(b * s, -1)
    selected, kls = None, []
    for i, layer in enumerate(model.layers):
        x, selected, kl = _layer(layer, x, rot, b, s, mode, topk, kl_rows, selected, observe, i)
        if kl is not None:
            kls.append(kl)
    hidden = model.norm(x)
    logits = model.lm_head(hidden).view(b, s, -1).float()
    if mtp is None:
        return logits, kls, None
    if s < 3:
        raise ValueError(f"ids: the MTP module needs >= 3 tokens a sequence, got {s}")
    y = mtp.project(model.embed_tokens(ids[:, 1:]), hidden.view(b, s, -1)[:, :-1]).reshape(b * (s - 1), -1)
    rows = None if kl_rows is None else kl_rows[kl_rows < s - 1]
    y, _, kl = _layer(mtp, y, rot.view(b, s, -1)[:, :-1].reshape(b * (s - 1), -1), b, s - 1, mode, topk,
                      rows, None)
    if kl is not None:
        kls.append(kl)
    return logits, kls, model.lm_head(mtp.shared_head.norm(y)).view(b, s - 1, -1).float()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy [nats / token]."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def mtp_loss(mtp_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the MTP module's predictions of the token after next [nats / token]."""
    return F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())


def stage_loss(model, ids: torch.Tensor, stage: str, kl_rows: torch.Tensor, mtp=None) -> tuple:
    """``(loss to minimize, {"lm": ..., "kl": ..., "mtp": ...})`` of one stage on a batch (see the module
    docstring); with ``mtp`` the dense and sparse stages add ``MTP_WEIGHT`` times its loss."""
    if stage == "warmup":  # the model is frozen (set_trainable): the graph holds only the indexers' terms
        _, kls, _ = run_with_mtp(model, mtp, ids, "warmup", kl_rows=kl_rows)
        kl = torch.stack(kls).mean()
        return kl, {"kl": kl.item()}
    logits, kls, mtp_logits = run_with_mtp(model, mtp, ids, stage, kl_rows=None if stage == "dense" else kl_rows)
    lm = lm_loss(logits, ids)
    loss, row = lm, {"lm": lm.item()}
    if kls:
        kl = torch.stack(kls).mean()
        loss, row["kl"] = loss + kl, kl.item()
    if mtp_logits is not None:
        extra = mtp_loss(mtp_logits, ids)
        loss, row["mtp"] = loss + MTP_WEIGHT * extra, extra.item()
    return loss, row


def set_trainable(model, stage: str, mtp=None) -> list:
    """Freeze per stage; returns the trainable parameters (dense: all but the indexers; warmup: the
    indexers; sparse: all), the MTP module's with the model's."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
    for n, p in _named(model, mtp):
        is_indexer = ".indexer." in n
        p.requires_grad_({"dense": not is_indexer, "warmup": is_indexer, "sparse": True}[stage])
    return [p for _, p in _named(model, mtp) if p.requires_grad]


# ---- evaluation ------------------------------------------------------------------------------
@torch.no_grad()
def heldout_loss(model, windows: list, mode: str, topk: int | None = None, autocast=None) -> float:
    """Mean next-token loss [nats / token] over ``windows`` (``[S]`` token tensors), one at a time."""
    total = 0.0
    for ids in windows:
        with autocast_ctx(ids.device, autocast):
            logits, _ = run(model, ids[None].to(model.device), mode, topk)
        total += float(lm_loss(logits, ids[None].to(model.device)))
    return total / max(1, len(windows))


@torch.no_grad()
def mtp_eval(model, mtp, windows: list, mode: str, topk: int | None = None, autocast=None) -> dict:
    """The MTP module on ``windows`` (teacher-forced): its loss on the token after next [nats / token], its
    top-1 accuracy there, and ``acceptance``: how often its argmax equals the main model's argmax for the
    same token (the share of drafts of one token that a greedy verify step accepts)."""
    loss = hits = agree = count = 0.0
    for ids in windows:
        ids = ids[None].to(model.device)
        with autocast_ctx(model.device, autocast):
            logits, _, mtp_logits = run_with_mtp(model, mtp, ids, mode, topk)
        draft, target = mtp_logits[0, :-1].argmax(-1), logits[0, 1:-1].argmax(-1)
        loss += float(mtp_loss(mtp_logits, ids)) * draft.numel()
        hits += float((draft == ids[0, 2:]).sum())
        agree += float((draft == target).sum())
        count += draft.numel()
    count = max(count, 1)
    return {"loss": loss / count, "accuracy": hits / count, "acceptance": agree / count}


@torch.no_grad()
def selection_recall(model, windows: list, topk: int, queries: int, autocast=None) -> dict:
    """Attention-mass recall of the indexer's top-``topk`` on the dense model: per layer the mean share of
    the head-averaged attention mass that the indexer's selection holds, and the most any ``topk``
    positions hold (the oracle), over ``queries`` query positions ``>= topk`` per window."""
    got = {}

    def observe(i, attn, h, qr, parts, rot):
        if attn.indexer is None:
            return
        probs = head_avg_probs(attn, *parts, 1, s, rows)[0]  # [Q, S]
        logits = indexer_logits(attn.indexer, h, qr, rot, 1, s, rows)[0]
        sel = logits.topk(topk, dim=-1).indices
        row = got.setdefault(i, {"indexer": 0.0, "oracle": 0.0})
        row["indexer"] += float(probs.gather(1, sel).sum(1).mean()) / len(windows)
        row["oracle"] += float(probs.topk(topk, dim=-1).values.sum(1).mean()) / len(windows)

    for ids in windows:
        s = ids.numel()
        if s <= topk:
            raise ValueError(f"windows: {s} tokens leave no query past topk = {topk}")
        rows = torch.linspace(topk, s - 1, min(queries, s - topk), device=model.device).long()
        with autocast_ctx(model.device, autocast):
            run(model, ids[None].to(model.device), "dense", observe=observe)
    layers = {i: {**v, "recall": v["indexer"] / max(v["oracle"], 1e-30)} for i, v in got.items()}
    mean = {k: sum(v[k] for v in layers.values()) / len(layers) for k in ("indexer", "oracle", "recall")}
    return {"per_layer": layers, "mean": mean}


def autocast_ctx(device, dtype):
    """bf16 autocast on CUDA when ``dtype`` says so; a no-op otherwise."""
    import contextlib
    if dtype is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype)


# ---- export: the DeepSeek-V3.2 HF layout -----------------------------------------------------
def _fp8_target(name: str, t: torch.Tensor) -> bool:
    """A decoder layer's or the MTP module's 2-D weight (a projection) whose both sides are whole 128-blocks
    (transformers' dequantizer needs them whole); not the embedding, the head or the norms."""
    return t.dim() == 2 and name.startswith("model.layers.") and not t.shape[0] % FP8_BLOCK and \
        not t.shape[1] % FP8_BLOCK


def hf_config(config: DSAConfig, dtype: torch.dtype, num_nextn: int = 0, fp8_kept: set | None = None) -> dict:
    """``config.json`` for transformers' ``DeepseekV32ForCausalLM`` and :meth:`DSAModel.from_pretrained`.
    A dense-MLP model is written as V3.2 writes its first dense layers: ``first_k_dense_replace`` =
    every layer (one routed expert declared, none built); ``num_nextn`` MTP layers; ``fp8_kept``
    (FP8 block weights, V3.2's ``quantization_config``): the layers' modules left unquantized, by the last
    part of their names; None: no quantization."""
    c = config
    if c.n_routed_experts is not None or c.rope_scaling is not None:
        raise ValueError("config: export writes dense-MLP models with plain RoPE (n_routed_experts=None, "
                         "rope_scaling=None)")
    out = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "dtype": str(dtype).removeprefix("torch."), "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "moe_intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads, "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
        "n_routed_experts": 1, "n_shared_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": c.num_hidden_layers, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim, "index_topk": c.index_topk, "num_nextn_predict_layers": num_nextn}
    if fp8_kept is not None:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                      "modules_to_not_convert": sorted(set(fp8_kept) | {"lm_head"})}
    return out


def export_tensors(model, mtp=None, dtype: torch.dtype = torch.float32, fp8: bool = False) -> dict:
    """The V3.2 checkpoint's tensors: ``model.`` + ours, ``lm_head.weight``, the MTP module as
    ``model.layers.{num_hidden_layers}.*`` (its embedding and head are the main model's and not repeated);
    with ``fp8`` each projection weight as e4m3 plus its ``weight_scale_inv``, the rest in ``dtype``."""
    tensors = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in model.state_dict().items()}
    if mtp is not None:
        prefix = f"model.layers.{model.config.num_hidden_layers}."
        state = mtp.state_dict()
        tensors.update({prefix + new: state[ours] for ours, new in mtp.export_names().items()})
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if fp8 and _fp8_target(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t)
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def export(model, tokenizer_file: str, out_dir: str, dtype: torch.dtype = torch.float32, meta=None, mtp=None,
           fp8: bool = False) -> str:
    """Write ``config.json``, ``model.safetensors`` (:func:`export_tensors`), ``tokenizer.json``,
    ``tokenizer_config.json`` (BOS, EOS, a ``role: content`` chat template) and ``generation_config.json``;
    ``meta``: strings for the safetensors header."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = export_tensors(model, mtp, dtype, fp8)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt", **(meta or {})})
    c = model.config
    kept = None
    if fp8:  # the layers' 2-D weights that stay unquantized, by module name
        kept = {n.removesuffix(".weight").rsplit(".", 1)[-1] for n, t in tensors.items()
                if n.startswith("model.layers.") and n.endswith(".weight") and t.dim() == 2
                and t.dtype != torch.float8_e4m3fn}
    files = {"config.json": hf_config(c, torch.bfloat16 if fp8 else dtype, 1 if mtp is not None else 0, kept),
             "tokenizer_config.json": {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE,
                                       "model_max_length": c.max_position_embeddings},
             "generation_config.json": {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id}}
    for name, data in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(data, f, indent=1)
    shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def import_export(export_dir: str, device) -> tuple:
    """``(model, mtp)``: trainable fp32 copies of an :func:`export` (FP8 block weights dequantized), the
    inverse of :func:`export_tensors`; ``mtp`` is None when the checkpoint has no MTP module."""
    from safetensors.torch import load_file

    from dsa.model.loading import SCALE_SUFFIX, dequantize_fp8_block

    # hf_config writes the dense MLP as first_k_dense_replace = every layer; the MTP layer past them is dense too
    # (the MTP module is kept beside the model, as training holds it: the model is built without one)
    config = DSAConfig.from_hf_config(os.path.join(export_dir, "config.json")).replace(n_routed_experts=None,
                                                                                       num_nextn_predict_layers=0)
    raw = load_file(os.path.join(export_dir, "model.safetensors"))
    tensors = {n: dequantize_fp8_block(t, raw[n + SCALE_SUFFIX]) if n + SCALE_SUFFIX in raw else t.float()
               for n, t in raw.items() if not n.endswith(SCALE_SUFFIX)}
    model = new_model(config, 0, device)
    prefix = f"model.layers.{config.num_hidden_layers}."
    model.load_state_dict({k: tensors[k if k.startswith("lm_head.") else "model." + k] for k in model.state_dict()})
    mtp = None
    if any(n.startswith(prefix) for n in tensors):
        mtp = new_mtp(config, 0, device)
        mtp.load_state_dict({ours: tensors[prefix + new] for ours, new in mtp.export_names().items()})
    return model, mtp


def replace_indexers(export_dir: str, model, mtp, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                     meta=None) -> dict:
    """Copy an :func:`export` to ``out_dir`` with only its indexer tensors taken from ``model`` and ``mtp``
    (stored as :func:`export` stores them); every other tensor stays as it was, byte for byte. Returns
    ``{"replaced": n, "kept": n}``."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = os.path.join(export_dir, "model.safetensors")
    tensors = load_file(src)
    with safe_open(src, "pt") as f:
        header = f.metadata() or {}
    new = export_tensors(model, mtp, dtype, fp8=any(t.dtype == torch.float8_e4m3fn for t in tensors.values()))
    names = [n for n in tensors if ".indexer." in n]
    if sorted(names) != sorted(n for n in new if ".indexer." in n):
        raise ValueError(f"model: its indexer tensors do not match those of {src}")
    tensors.update({n: new[n] for n in names})
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(export_dir):
        if name != "model.safetensors":
            shutil.copyfile(os.path.join(export_dir, name), os.path.join(out_dir, name))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={**header, **(meta or {})})
    return {"replaced": len(names), "kept": len(tensors) - len(names)}


# ---- the tokenizer ----------------------------------------------------------------------------
def train_tokenizer(files: list, vocab_size: int, out_file: str, max_bytes: int | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` trained on ``files`` (documents
    separated by ``<|endoftext|>``; with ``max_bytes``, each file's first documents up to its share of
    ``max_bytes`` by size), BOS ``<|bos|>`` = 0 and EOS ``<|endoftext|>`` = 1, BOS added by ``encode``;
    saved to ``out_file``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    total = sum(os.path.getsize(p) for p in files)

    def docs():
        for path in files:
            budget = None if max_bytes is None else max_bytes * os.path.getsize(path) / max(total, 1)
            with open(path, encoding="utf-8") as f:
                for d in f.read().split(EOS):
                    if d.strip():
                        yield d.strip()
                        if budget is not None:
                            budget -= len(d)
                            if budget <= 0:
                                break
    tok.train_from_iterator(docs(), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    tok.save(out_file)
    return tok


def tokenize_file(path: str, tok):
    """One text file -> uint16/int32 ids: each document as ``BOS ids EOS``."""
    import numpy as np
    with open(path, encoding="utf-8") as f:
        docs = [d.strip() for d in f.read().split(EOS) if d.strip()]
    ids = []
    for enc in tok.encode_batch(docs):  # the post-processor adds BOS
        ids.extend(enc.ids)
        ids.append(1)
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 1 << 16 else np.int32)
