"""DSAAttention: MLA with absorbed weights over the paged latent cache, sparse where DSA says so.

Per step (rows from a :class:`dsa.plan.BatchPlan`)::

    qr = q_a_layernorm(q_a_proj(x)); q = q_b_proj(qr) -> [q_nope | q_pe]          # [T, H, D_NOPE + D_R]
    [kv_c | k_pe] = kv_a_proj_with_mqa(x); kv_c = kv_a_layernorm(kv_c)              # [T, 512], [T, 64]
    interleaved RoPE (YaRN) on q_pe and k_pe; latent row [kv_c | k_pe] written at the row's slot
    q_abs = [q_nope @ W_UK_T | q_pe]                                                # [T, H, 576]
    sparse rows: sparse_mla(q_abs, cache, top-k slots)        (own indexer, or the reused selection)
    dense rows:  dense_mla_decode / sparse kernel with every position (decode), MHA via SDPA or the
                 absorbed kernel (prefill): the same function, chosen for speed by the plan
    out [T, H, 512] @ W_UV -> [T, H, D_V] -> o_proj
"""
import torch
import torch.nn.functional as F
from torch import nn

from dsa.cache import IndexerKeyCache, LatentCache, write_latent
from dsa.indexer import LightningIndexer
from dsa.kernels import apply_rope, dense_mla_decode, positions_to_slots, sparse_mla
from dsa.kernels.sparse_mla import gather_latent_rows

from .absorb import absorb_kv_b
from .config import DSAConfig, layer_runs_indexer, softmax_scale
from .layers import RMSNorm


class DSAAttention(nn.Module):
    def __init__(self, config: DSAConfig, layer_id: int):
        super().__init__()
        c = self.config = config
        self.layer_id = layer_id
        h = c.num_attention_heads
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * c.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, h * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=c.attention_bias)
        self.runs_indexer = layer_runs_indexer(c, layer_id)
        self.indexer = LightningIndexer(c) if self.runs_indexer else None
        self.softmax_scale = softmax_scale(c)
        self.w_uk_t = self.w_uv = None  # built once by absorb()

    def absorb(self) -> None:
        """Build ``W_UK_T [H, D_NOPE, R]`` and ``W_UV [H, R, D_V]`` from ``kv_b_proj`` (after loading)."""
        c = self.config
        self.w_uk_t, self.w_uv = absorb_kv_b(self.kv_b_proj.weight.detach(), c.num_attention_heads,
                                             c.qk_nope_head_dim, c.v_head_dim)

    def forward(self, x: torch.Tensor, plan, latent: LatentCache, index_cache: IndexerKeyCache | None, cos, sin,
                reused: dict | None, stats: dict) -> tuple[torch.Tensor, dict | None]:
        """``x [T, hidden]`` -> ``[T, hidden]``; also returns the top-k slots the sparse rows used
        (``{path: [rows, K] int32}``), for the layers after it that skip the indexer."""
        c = self.config
        t, h = x.shape[0], c.num_attention_heads
        qr, q_nope, q_pe, kv_c, k_pe = self.project(x, plan.positions, cos, sin)
        write_latent(latent, kv_c, k_pe, plan.slot_mapping)

        selected = reused
        if self.indexer is not None:
            selected = self.indexer(x, qr, plan, index_cache, cos, sin, c.index_topk)

        out = torch.full((t, h, c.v_head_dim), float("nan"), dtype=x.dtype, device=x.device)
        absorbed = ("sparse_decode", "sparse_prefill", "dense_decode", "dense_prefill_absorbed")
        q_abs = self.absorbed_query(q_nope, q_pe) if any(plan.segments[p] for p in absorbed) else None  # [T, H, 576]
        for path in ("sparse_decode", "sparse_prefill"):
            rows = plan.rows_of(path)
            if len(rows):
                o, _ = sparse_mla(q_abs[rows], latent.data, selected[path], self.softmax_scale)
                out[rows] = self._up_v(o)
        self._dense_decode(q_abs, plan, latent, out)
        for seg in plan.segments["dense_prefill_absorbed"]:
            rows = slice(seg.row0, seg.row1)
            o, _ = dense_mla_decode(q_abs[rows].unsqueeze(0), latent.data, plan.block_table[seg.req:seg.req + 1],
                                    torch.tensor([seg.seq_len], dtype=torch.int32, device=x.device), self.softmax_scale)
            out[rows] = self._up_v(o[0])
        for seg in plan.segments["dense_prefill_mha"]:
            out[seg.row0:seg.row1] = self._mha(q_nope[seg.row0:seg.row1], q_pe[seg.row0:seg.row1], seg, plan, latent,
                                               stats)
        return self.o_proj(out.flatten(1)), selected

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos, sin):
        """``(qr [T, q_lora], q_nope [T, H, D_NOPE], q_pe [T, H, D_R], kv_c [T, 512], k_pe [T, 64])``,
        RoPE (interleaved) applied to ``q_pe`` and ``k_pe``."""
        c = self.config
        t = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x)) if c.q_lora_rank else x
        q = (self.q_b_proj(qr) if c.q_lora_rank else self.q_proj(x)).view(t, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, :c.kv_lora_rank])
        q_pe = apply_rope(q_pe, positions, cos, sin, True)
        k_pe = apply_rope(kv[:, c.kv_lora_rank:], positions, cos, sin, True)
        return qr, q_nope, q_pe, kv_c, k_pe

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[q_nope @ W_UK_T | q_pe]`` ``[T, H, 576]``."""
        return torch.cat((torch.einsum("thd,hdr->thr", q_nope, self.w_uk_t), q_pe), dim=-1)

    def _up_v(self, o: torch.Tensor) -> torch.Tensor:
        """Latent-space output ``[R, H, 512]`` -> ``[R, H, D_V]``."""
        return torch.einsum("thr,hrd->thd", o, self.w_uv)

    def _dense_decode(self, q_abs, plan, latent, out) -> None:
        segs = plan.segments["dense_decode"]
        if not segs:
            return
        rows = plan.rows_of("dense_decode")
        reqs = torch.tensor([s.req for s in segs], device=rows.device)
        table, lens = plan.block_table[reqs], plan.seq_lens[reqs]
        if plan.decode_sparse_kernel:  # the same function through the sparse kernel, every position selected
            width = -(-max(s.seq_len for s in segs) // 16) * 16  # the Triton kernel takes K in multiples of 16
            positions = torch.arange(width, dtype=torch.int32, device=rows.device).expand(len(segs), width)
            slots = positions_to_slots(positions.contiguous(), table,
                                       torch.arange(len(segs), dtype=torch.int32, device=rows.device), lens,
                                       plan.block_size)
            o, _ = sparse_mla(q_abs[rows], latent.data, slots, self.softmax_scale)
        else:
            o, _ = dense_mla_decode(q_abs[rows].unsqueeze(1), latent.data, table, lens, self.softmax_scale)
            o = o[:, 0]
        out[rows] = self._up_v(o)

    def _mha(self, q_nope, q_pe, seg, plan, latent, stats) -> torch.Tensor:
        """Up-projected MHA for one request's dense prefill rows (SDPA, bottom-right causal mask)."""
        c = self.config
        h, s = c.num_attention_heads, seg.seq_len
        pos = torch.arange(s, device=q_nope.device)
        slots = plan.block_table[seg.req].long()[pos // plan.block_size] * plan.block_size + pos % plan.block_size
        rows = gather_latent_rows(latent.data, slots, q_nope.dtype)  # [S, 576]
        kv = F.linear(rows[:, :c.kv_lora_rank], self.kv_b_proj.weight).view(s, h, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat((k_nope, rows[:, None, c.kv_lora_rank:].expand(s, h, c.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [Q, H, 192]
        padded = 0
        if v.shape[-1] != k.shape[-1]:  # equal head dims let SDPA pick a fused kernel instead of the math path
            v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
            padded = v.numel()
        # the workspace: the up-projected [S, H, D_NOPE + D_V], the [S, H, D_NOPE + D_R] keys (and padded values)
        stats["workspace_bytes"] = max(stats.get("workspace_bytes", 0),
                                       (kv.numel() + k.numel() + padded) * k.element_size())
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, len, D]: 4-D for the fused kernels
        if seg.pos0 == 0:  # no prefix: top-left and bottom-right causal alignment coincide
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:  # query i sits at position pos0 + i and sees keys [0, pos0 + i]: bottom-right aligned
            mask = pos[None, :] <= (seg.pos0 + torch.arange(seg.rows, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return o[0, ..., :c.v_head_dim].transpose(0, 1)
