"""LightningIndexer: per-layer FP8 scoring of every cached position and top-k straight to slots.

Math (DESIGN section 5), from the attention input ``x [T, hidden]`` and the query latent
``qr [T, q_lora_rank]``::

    q = wq_b(qr).view(T, HI, DI); k = k_norm(wk(x))          # LayerNorm with bias, fp32 math
    RoPE on the first D_R dims of q and k (NeoX, or interleaved when configured)
    fp8:   keys -> Hadamard -> ue8m0 FP8 in the cache; q -> Hadamard -> FP8, weights fold q_scale
    exact: keys kept unquantized, no Hadamard; weights = w * HI**-0.5 * DI**-0.5
    logit[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] . k[s])
"""
import torch
import torch.nn.functional as F
from torch import nn

from dsa.cache import IndexerKeyCache, gather_indexer_keys, write_indexer_keys
from dsa.config import DSAConfig
from dsa.kernels import (apply_rope, indexer_logits_paged, indexer_logits_ragged, indexer_query_prep, topk_slots)
from dsa.kernels.indexer_query_prep import weight_scale

RAGGED_CHUNK_ELEMS = 1 << 26  # rows x keys per ragged logits call (256 MiB of fp32 logits)


class LightningIndexer(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        hi, di = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank or config.hidden_size, hi * di, bias=False)
        self.wk = nn.Linear(config.hidden_size, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, hi, bias=False)

    def project(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cos, sin):
        """``(q [T, HI, DI], k [T, DI], w [T, HI] fp32)`` after RoPE, in the model dtype."""
        c = self.config
        t = x.shape[0]
        q = self.wq_b(qr).view(t, c.index_n_heads, c.index_head_dim)
        k = F.layer_norm(self.wk(x).float(), (c.index_head_dim,), self.k_norm.weight.float(),
                         self.k_norm.bias.float(), self.k_norm.eps).to(x.dtype)
        r = c.qk_rope_head_dim
        q = torch.cat((apply_rope(q[..., :r], positions, cos, sin, c.indexer_rope_interleave), q[..., r:]), dim=-1)
        k = torch.cat((apply_rope(k[:, :r], positions, cos, sin, c.indexer_rope_interleave), k[:, r:]), dim=-1)
        w = F.linear(x.float(), self.weights_proj.weight.float())  # [T, HI] fp32, whatever the model dtype
        return q, k, w

    def forward(self, x, qr, plan, cache: IndexerKeyCache, cos, sin, k: int) -> dict:
        """Write this step's keys; return ``{path: slots [rows, k] int32}`` for the plan's sparse rows."""
        c = self.config
        exact = c.indexer_precision == "exact"
        q, key, w = self.project(x, qr, plan.positions, cos, sin)
        write_indexer_keys(cache, key, plan.slot_mapping, hadamard=c.indexer_hadamard and not exact)
        if exact:
            weights = w * weight_scale(c.index_n_heads, c.index_head_dim)
        else:
            q, weights = indexer_query_prep(q, w, c.indexer_hadamard)
        out = {}
        rows = plan.rows_of("sparse_decode")
        if len(rows):
            reqs = torch.tensor([s.req for s in plan.segments["sparse_decode"]], device=rows.device)
            table, lens = plan.block_table[reqs], plan.seq_lens[reqs]
            logits = indexer_logits_paged(q[rows].unsqueeze(1), weights[rows].unsqueeze(1), cache.data, table, lens,
                                          cache.block_size)
            out["sparse_decode"] = topk_slots(logits, lens, k, table,
                                              torch.arange(len(rows), dtype=torch.int32, device=rows.device),
                                              lens, cache.block_size)
        prefill = []
        for seg in plan.segments["sparse_prefill"]:
            table, lens = plan.block_table[seg.req:seg.req + 1], plan.seq_lens[seg.req:seg.req + 1]
            keys, k_scale = gather_indexer_keys(cache, table, lens)  # [S, DI], positions 0 .. S-1
            step = max(1, RAGGED_CHUNK_ELEMS // max(1, keys.shape[0]))
            for r0 in range(seg.row0, seg.row1, step):
                r1 = min(seg.row1, r0 + step)
                valid = plan.valid_lens[r0:r1]
                zeros = torch.zeros_like(valid)
                logits = indexer_logits_ragged(q[r0:r1], weights[r0:r1], keys, k_scale, zeros, valid)
                prefill.append(topk_slots(logits, valid, k, table, zeros, lens, cache.block_size))
        if prefill:
            out["sparse_prefill"] = torch.cat(prefill)
        return out
