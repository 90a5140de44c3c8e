"""The multi-token-prediction (MTP) module: DeepSeek-V3's next-n layer, one home for inference and training.

At position ``i`` it reads the main model's hidden state ``h[i]`` (after the final norm: what vLLM and
SGLang hand a draft model) and the embedding of the token after it, ``t[i + 1]``, and predicts ``t[i + 2]``::

    x = eh_proj(cat(enorm(embed(t[i + 1])), hnorm(h[i])))      # the order of vLLM's deepseek_mtp.py
    y = decoder_layer(x) at position i                         # attention over the MTP layer's own caches
    logits = lm_head(shared_head.norm(y))                      # the main model's embedding and head

Drafting the token after that feeds ``y`` (before ``shared_head.norm``) back as the hidden state with the
drafted token's embedding, one position later (vLLM's and SGLang's chaining of one MTP layer). The module
is a :class:`~dsa.model.model.DecoderLayer` with three more parts, so its parameter names are the
checkpoint's own below ``model.layers.{num_hidden_layers}.`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, ``self_attn.*`` with its indexer where the checkpoint has one, ``mlp.*``); the
checkpoint's copies of the embedding and head in that layer (``embed_tokens``, ``shared_head.head``) are
the main model's and are not loaded twice. vLLM also zeroes the embedding at position 0; the trained
default was trained without that, and so runs without it here (it only touches the MTP row of position 0).
"""
import torch
from torch import nn

from dsa.config import DSAConfig
from dsa.model.decoder import DecoderLayer
from dsa.model.layers import RMSNorm, is_moe_layer
from dsa.model.parallel import TensorParallel


def mtp_layer_shape(config: DSAConfig, names=None) -> tuple:
    """``(runs_indexer, moe)`` of the MTP layer: from the checkpoint's tensor names (ours, without
    ``model.``, as ``mtp.*``) when given, else the config's (an indexer when the model has one; MoE
    as the config would make layer ``num_hidden_layers``)."""
    if names is None:
        return config.index_topk is not None, is_moe_layer(config, config.num_hidden_layers)
    names = set(names)
    return "mtp.self_attn.indexer.wk.weight" in names, "mtp.mlp.gate.weight" in names


class MTPLayer(nn.Module):
    """One MTP module (module docstring): ``enorm``, ``hnorm``, ``eh_proj [hidden, 2 hidden]``, a decoder
    layer's parts at layer id ``num_hidden_layers`` and ``shared_head.norm``. ``forward(x, step)`` is the
    decoder layer's; :meth:`project` makes its input."""

    def __init__(self, config: DSAConfig, tp: TensorParallel = TensorParallel(), runs_indexer: bool | None = None,
                 moe: bool | None = None):
        super().__init__()
        default_indexer, default_moe = mtp_layer_shape(config)
        layer = DecoderLayer(config, config.num_hidden_layers, tp,
                                 default_indexer if runs_indexer is None else runs_indexer,
                                 default_moe if moe is None else moe)
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        h = config.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, config.rms_norm_eps), RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, config.rms_norm_eps)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``eh_proj(cat(enorm(embeds), hnorm(hidden)))``: ``[..., hidden]`` from the next tokens'
        embeddings and the hidden states (the main model's after its final norm, or this module's own)."""
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        h, x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step), residual=x)
        return x + self.mlp(h)


@torch.no_grad()
def mtp_logits(model, input_ids: torch.Tensor) -> tuple:
    """The MTP module over full sequences, through the step path (the kernels, paged caches):
    ``(logits [B, S - 1, vocab] fp32,
    hidden [B, S - 1, hidden])`` for ``input_ids [B, S]`` (``S >= 2``): row ``i`` reads the main
    model's normed hidden state at ``i`` and ``input_ids[:, i + 1]`` and predicts ``input_ids[:, i + 2]``;
    ``hidden`` is the layer's output before ``shared_head.norm``. Temporary caches, as ``model(ids)``.
    Its torch reference is the trainer's differentiable path, :func:`dsa.quality.train.run_with_mtp`
    (plain SDPA over each query's top-k of the exact indexer logits), which trains this same module."""
    from dsa.kernels.common import cdiv
    mtp = model.mtp
    if mtp is None:
        raise ValueError("model: it has no MTP module (num_nextn_predict_layers = 0)")
    b, s = input_ids.shape
    if s < 2:
        raise ValueError(f"input_ids: the MTP module needs >= 2 tokens a sequence, got {s}")
    per = cdiv(s, model.config.block_size)
    caches = model.allocate_caches(b * per, mtp=True)
    table = torch.arange(b * per, dtype=torch.int32).view(b, per)
    plan = model.plan([s] * b, [0] * b, table, input_ids=input_ids.reshape(-1))
    _, h = model.step(plan, caches, return_hidden=True)
    short = model.plan([s - 1] * b, [0] * b, table, input_ids=input_ids[:, 1:].reshape(-1))
    hidden = h.view(b, s, -1)[:, :-1].reshape(b * (s - 1), -1)
    logits, y = model.mtp_step(short, caches, input_ids[:, 1:].reshape(-1), hidden)
    return logits.view(b, s - 1, -1), y.view(b, s - 1, -1)
