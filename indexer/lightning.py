"""LightningIndexer: per-layer FP8 scoring of every cached position and top-k straight to slots.

Math (DeepSeek-V3.2 and its reference inference code), from the attention input ``x [T, hidden]`` and the query latent
``qr [T, q_lora_rank]``::

    q = wq_b(qr).view(T, HI, DI); k = k_norm(wk(x))          # LayerNorm with bias, fp32 math
    RoPE on the first D_R dims of q and k (NeoX, or interleaved when configured)
    fp8:   keys -> Hadamard -> ue8m0 FP8 in the cache; q -> Hadamard -> FP8, weights fold q_scale
    exact: keys kept unquantized, no Hadamard; weights = w * HI**-0.5 * DI**-0.5
    logit[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] . k[s])

Decode rows are scored by paged logits over their block tables, prefill rows by ragged logits
over their request's gathered keys; both go to ``topk_slots``, whose tie rule makes each row's
selection a function of that row alone.
"""
import torch
import torch.nn.functional as F
from torch import nn

from dsa.cache import IndexerKeyCache, gather_indexer_keys, write_indexer_keys
from dsa.config import DSAConfig
from dsa.kernels import indexer_logits_paged, indexer_logits_ragged, indexer_query_prep, rope_rotate, topk_slots
from dsa.kernels.common import cdiv
from dsa.kernels.indexer_query_prep import weight_scale

from .batch import IndexerBatch, Selection

RAGGED_CHUNK_ELEMS = 1 << 26  # rows x keys per ragged logits call (256 MiB of fp32 logits)


class LightningIndexer(nn.Module):
    """One layer's indexer: ``project`` (queries, keys, head weights after RoPE) and ``forward``
    (write the step's keys, score the cached positions, select the top-k as cache slots)."""

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        hi, di = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank or config.hidden_size, hi * di, bias=False)
        self.wk = nn.Linear(config.hidden_size, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, hi, bias=False)

    def project(self, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor):
        """``(q [T, HI, DI], k [T, DI], w [T, HI] fp32)`` after RoPE on the first ``D_R`` dims, in the
        model dtype; ``rot [T, D_R / 2]`` from :func:`dsa.kernels.rope_at`. ``x`` and ``qr`` may carry
        rows past ``T`` that pad the GEMMs' row count (:func:`dsa.model.route.gemm_rows`): dropped after them."""
        c = self.config
        t, r = rot.shape[0], c.qk_rope_head_dim
        q = self.wq_b(qr)[:t].view(t, c.index_n_heads, c.index_head_dim)
        k = F.layer_norm(self.wk(x)[:t].float(), (c.index_head_dim,), self.k_norm.weight.float(),
                         self.k_norm.bias.float(), self.k_norm.eps).to(x.dtype)
        q, k = (_rotate_front(t, rot, r, c.indexer_rope_interleave) for t in (q, k))
        w = F.linear(x.float(), self.weights_proj.weight.float())[:t]  # [T, HI] fp32, whatever the model dtype
        return q, k, w

    def score(self, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor, queries: torch.Tensor,
              precision: str | None = None) -> torch.Tensor:
        """``[Q, T]`` fp32 logits of rows ``queries`` (``[Q]`` int64 positions) of one sequence
        ``x [T, hidden]`` against its keys ``0 .. T-1``, ``-inf`` past each query: the scoring the
        model's prefill runs, for tools that measure selection outside a step.

        ``precision`` (default: the config's): ``"exact"`` keeps the model dtype, no Hadamard, no
        FP8 (differentiable; fitting uses it); ``"fp8"`` writes the keys into a paged FP8 key cache
        (132-byte records, Hadamard-rotated when configured), gathers them back and scores FP8
        queries from ``indexer_query_prep`` with ``indexer_logits_ragged``, as :meth:`forward` does.
        """
        c = self.config
        precision = precision or c.indexer_precision
        if precision not in ("exact", "fp8"):
            raise ValueError(f"precision: expected 'exact' or 'fp8', got {precision!r}")
        q, k, w = self.project(x, qr, rot)
        q, w = q[queries], w[queries]
        ends = (queries + 1).to(torch.int32)
        starts = torch.zeros_like(ends)
        if precision == "exact":
            return indexer_logits_ragged(q, w * weight_scale(c.index_n_heads, c.index_head_dim), k, None, starts, ends)
        t, p = x.shape[0], c.block_size
        cache = IndexerKeyCache(cdiv(t, p), p, head_dim=c.index_head_dim, device=x.device)
        positions = torch.arange(t, device=x.device)
        write_indexer_keys(cache, k, positions, hadamard=c.indexer_hadamard)
        table = torch.arange(cache.num_blocks, dtype=torch.int32, device=x.device)[None]
        k8, k_scale = gather_indexer_keys(cache, table, torch.tensor([t], dtype=torch.int32, device=x.device), total=t)
        q8, weights = indexer_query_prep(q.contiguous(), w.contiguous(), c.indexer_hadamard)
        return indexer_logits_ragged(q8, weights, k8, k_scale, starts, ends)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, batch: IndexerBatch, cache: IndexerKeyCache,
                rot: torch.Tensor) -> Selection:
        """Write this step's keys; return the top-k slots of the batch's sparse rows (the decode
        rows' are the plan's ``every_position`` when their contexts fit in ``index_topk``)."""
        c, k = self.config, self.config.index_topk
        exact = c.indexer_precision == "exact"
        q, key, w = self.project(x, qr, rot)
        write_indexer_keys(cache, key, batch.slot_mapping, hadamard=c.indexer_hadamard and not exact)
        d = batch.decode  # the decode rows to score, as the plan routed them
        if d is None and not batch.prefill:
            return Selection(batch.every_position, None)
        if exact:
            weights = w * weight_scale(c.index_n_heads, c.index_head_dim)
        else:
            q, weights = indexer_query_prep(q, w, c.indexer_hadamard)
        decode = batch.every_position
        if d is not None:  # [R * N] rows: N query rows per request, each key read once for all of them
            n = d.next_n
            logits = indexer_logits_paged(q[d.rows].unflatten(0, (-1, n)), weights[d.rows].unflatten(0, (-1, n)),
                                          cache.data, d.block_table, d.seq_lens, cache.block_size,
                                          max_seq_len=d.max_seq_len)
            decode = topk_slots(logits, d.lengths, k, d.block_table, d.row_ids, d.seq_lens, cache.block_size)
        prefill = []
        for seg in batch.prefill:
            # [S, DI] keys of positions 0 .. S-1, sized on the host
            keys, k_scale = gather_indexer_keys(cache, seg.block_table, seg.seq_len, total=seg.num_keys)
            step = max(1, RAGGED_CHUNK_ELEMS // max(1, seg.num_keys))
            for r0 in range(seg.row0, seg.row1, step):
                r1 = min(seg.row1, r0 + step)
                valid, starts = seg.valid_lens[r0 - seg.row0:r1 - seg.row0], batch.zeros[r0:r1]
                logits = indexer_logits_ragged(q[r0:r1], weights[r0:r1], keys, k_scale, starts, valid)
                prefill.append(topk_slots(logits, valid, k, seg.block_table, starts, seg.seq_len, cache.block_size))
        return Selection(decode, torch.cat(prefill) if prefill else None)


def _rotate_front(x: torch.Tensor, rot: torch.Tensor, r: int, interleaved: bool) -> torch.Tensor:
    """``x [T, ..., DI]`` with RoPE on its first ``r`` dims: in place (one launch on CUDA; ``x`` is the step's
    own), or a new tensor while autograd records (fitting: an in-place write would break its graph)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return torch.cat((rope_rotate(x[..., :r], rot, interleaved), x[..., r:]), dim=-1)
    rope_rotate(x[..., :r], rot, interleaved, out=x[..., :r])
    return x
