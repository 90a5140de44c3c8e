"""DSAAttention: MLA with absorbed weights over the paged latent cache, sparse where DSA says so.

Per step (rows from a :class:`dsa.model.plan.BatchPlan`)::

    qr = q_a_layernorm(q_a_proj(x)); q = q_b_proj(qr) -> [q_nope | q_pe]          # [T, H, D_NOPE + D_R]
    [kv_c | k_pe] = kv_a_proj_with_mqa(x); kv_c = kv_a_layernorm(kv_c)              # [T, 512], [T, 64]
    interleaved RoPE (YaRN) on q_pe and k_pe; latent row [kv_c | k_pe] written at the row's slot
    q_abs = [q_nope @ W_UK_T | q_pe]                                                # [T, H, 576]
    sparse rows: sparse_mla(q_abs, cache, top-k slots)        (own indexer, or the reused selection)
    dense rows:  dense_mla_decode / sparse kernel with every position (decode), MHA via SDPA or the
                 absorbed kernel (prefill): the same function, chosen for speed by the plan
    out [T, H, 512] @ W_UV -> [T, H, D_V] -> o_proj

The plan's :class:`~dsa.model.route.Route` says which path serves which rows; the layer reads it.
Decode rows of a model with an indexer always take top-k + the sparse kernel (a row whose context
fits in ``index_topk`` is handed every position), so a row's kernel never depends on its batch.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dsa.cache import LatentCache, write_latent
from dsa.config import DSAConfig, layer_runs_indexer, softmax_scale
from dsa.indexer import LightningIndexer
from dsa.kernels import dense_mla_decode, rope_rotate, sparse_mla
from dsa.kernels.sparse_mla import gather_latent_rows
from dsa.model.absorb import absorb_kv_b
from dsa.model.layers import RMSNorm
from dsa.model.parallel import TensorParallel
from dsa.model.route import gemm_rows

# The SDPA backends of the MHA prefill path: every one but cuDNN's. PyTorch prefers cuDNN attention on
# Hopper and Blackwell (sm90 / sm100, a recent cuDNN), and cuDNN attention builds one execution plan per
# shape it meets and keeps it in a thread-local map with no bound (MHAGraphCache): a server's prefill
# segments bring a new (query rows, keys) shape with almost every prompt, so that map grew the host's heap
# with the requests served (issue #37): 1.75 MB a new causal shape, 2.1 MB a new masked one on the H200
# (`benchmarks/results/sdpa-host-memory-h200-2026-12-02.json`), against 6.6 kB (flash, causal) and 262 kB
# (memory-efficient, a materialized mask) with these backends. Behind a prefix the mask is
# `causal_lower_right`, which flash attention takes without a mask tensor.
MHA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DSAAttention(nn.Module):
    """MLA with DSA: projections, RoPE, the latent-cache write, the layer's indexer (or the reused
    selection), and attention per row path; weights absorbed once by :meth:`absorb`."""

    def __init__(self, config: DSAConfig, layer_id: int, tp: TensorParallel = TensorParallel(),
                 runs_indexer: bool | None = None):
        super().__init__()
        c = self.config = config
        self.layer_id, self.tp = layer_id, tp
        h = self.num_heads = c.num_attention_heads // tp.size  # this rank's heads
        tp.split(c.num_attention_heads, "num_attention_heads")
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
        # the MTP module's layer (past num_hidden_layers) says for itself whether it has an indexer
        self.runs_indexer = layer_runs_indexer(c, layer_id) if runs_indexer is None else runs_indexer
        self.indexer = LightningIndexer(c) if self.runs_indexer else None
        self.softmax_scale = softmax_scale(c)
        self.w_uk_t = self.w_uv = None  # built once by absorb()

    def absorb(self) -> None:
        """Build ``W_UK_T [H, D_NOPE, R]`` and ``W_UV [H, R, D_V]`` from ``kv_b_proj`` (after loading)."""
        c = self.config
        self.w_uk_t, self.w_uv = absorb_kv_b(self.kv_b_proj.weight.detach(), self.num_heads,
                                             c.qk_nope_head_dim, c.v_head_dim)

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        """``x [T', hidden]`` -> ``[T', hidden]`` for the ``T`` rows of ``step.plan`` (a ``StepContext``),
        ``T' >= T``: the rows past ``T`` pad the GEMMs' row count (:func:`~dsa.model.route.gemm_rows`),
        go through the projections only and come out as zeros; a layer that runs its indexer leaves its
        selection in ``step.selection`` for the layers after it that skip theirs."""
        c, plan = self.config, step.plan
        t, h = plan.num_tokens, self.num_heads
        latent, index_cache = step.caches.latent[self.layer_id], step.caches.index[self.layer_id]
        qr, q_nope, q_pe, kv_c, k_pe = self.project(x, step.rope)
        write_latent(latent, kv_c, k_pe, plan.slot_mapping)
        if self.indexer is not None:
            step.selection = self.indexer(x, qr, plan.indexer, index_cache, step.rope)
            if self.tp.check_selection:
                for part in (step.selection.decode, step.selection.prefill):
                    if part is not None:
                        self.tp.check_same(f"layer {self.layer_id}", part)

        d, sparse_rows, routed = plan.decode, plan.sparse_prefill_rows, plan.route
        any_absorbed = d is not None or sparse_rows is not None or plan.absorbed
        q_abs = self.absorbed_query(q_nope, q_pe) if any_absorbed else None  # [T, H, 576]
        if routed.decode_only:  # every row decodes: no gather, no scatter
            return self._out(self._up_v(self._decode(q_abs, d, routed.sparse_decode, latent, step.selection)))
        # the rows past T (GEMM padding) come out as zeros; each path's latent outputs go up through W_UV
        # at that path's row count: a decode batch's, a dense segment's (at most index_topk rows) or the
        # sparse prefill rows' padded to GEMM_ROW_ALIGN (the padding rows name no slot: zeros, dropped)
        out = torch.full((x.shape[0], h, c.v_head_dim), float("nan"), dtype=x.dtype, device=x.device)
        out[t:] = 0
        if d is not None:
            out[d.rows] = self._up_v(self._decode(q_abs[d.rows], d, routed.sparse_decode, latent, step.selection))
        if sparse_rows is not None:
            n = sparse_rows.shape[0]
            rows, slots = sparse_rows, step.selection.prefill
            if pad := gemm_rows(n, False) - n:
                rows, slots = F.pad(rows, (0, pad)), F.pad(slots, (0, 0, 0, pad), value=-1)
            o, _ = sparse_mla(q_abs[rows], latent.data, slots, self.softmax_scale)
            out[sparse_rows] = self._up_v(o)[:n]
        for seg in plan.absorbed:
            o, _ = dense_mla_decode(q_abs[seg.rows].unsqueeze(0), latent.data, seg.block_table, seg.seq_len,
                                    self.softmax_scale)
            out[seg.rows] = self._up_v(o[0])
        for seg in plan.mha:
            out[seg.rows] = self._mha(q_nope[seg.rows], q_pe[seg.rows], seg, latent)
        return self._out(out)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of ``[T, H, D_V]``; under tensor parallelism a row-parallel projection of this
        rank's heads, summed over the ranks (the bias added once, after the sum)."""
        if self.tp.size == 1:
            return self.o_proj(out.flatten(1))
        y = self.tp.all_reduce(F.linear(out.flatten(1), self.o_proj.weight))
        return y if self.o_proj.bias is None else y + self.o_proj.bias

    def _decode(self, q_abs: torch.Tensor, d, sparse: bool, latent: LatentCache, selection) -> torch.Tensor:
        """Latent-space attention ``[R, H, 512]`` of the decode rows: top-k + sparse kernel when the
        plan routes them so (a model with an indexer; a short row's top-k is every position), else
        the dense absorbed kernel."""
        if sparse:
            return sparse_mla(q_abs, latent.data, selection.decode, self.softmax_scale)[0]
        q = q_abs.unflatten(0, (-1, d.next_n))  # [R, N, H, 576]: row j of a request sees [0, S - N + j]
        return dense_mla_decode(q, latent.data, d.block_table, d.seq_lens, self.softmax_scale)[0].flatten(0, 1)

    def project(self, x: torch.Tensor, rot: torch.Tensor):
        """``(qr [T', q_lora], q_nope [T', H, D_NOPE], q_pe [T, H, D_R], kv_c [T, 512], k_pe [T, 64])``
        of ``x [T', hidden]``, RoPE (interleaved) applied to ``q_pe`` and ``k_pe``; ``rot [T, D_R / 2]``
        from :func:`dsa.kernels.rope_at` (the step's per-token rotations; rows past ``T`` pad the GEMMs,
        and ``qr`` and ``q_nope`` keep them for the GEMMs after)."""
        c = self.config
        t = rot.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x)) if c.q_lora_rank else x
        q = (self.q_b_proj(qr) if c.q_lora_rank else self.q_proj(x)).view(x.shape[0], self.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)[:t]
        kv_c = self.kv_a_layernorm(kv[:, :c.kv_lora_rank])
        q_pe = rope_rotate(q_pe[:t], rot, True)
        k_pe = rope_rotate(kv[:, c.kv_lora_rank:], rot, True)
        return qr, q_nope, q_pe, kv_c, k_pe

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[q_nope @ W_UK_T | q_pe]`` ``[T, H, 576]`` (``q_nope`` may carry padding rows past ``q_pe``'s
        ``T``: the GEMM runs over them, the result stops at ``T``)."""
        t = q_pe.shape[0]
        return torch.cat((torch.einsum("thd,hdr->thr", q_nope, self.w_uk_t)[:t], q_pe), dim=-1)

    def _up_v(self, o: torch.Tensor) -> torch.Tensor:
        """Latent-space output ``[R, H, 512]`` -> ``[R, H, D_V]``."""
        return torch.einsum("thr,hrd->thd", o, self.w_uv)

    def _mha(self, q_nope, q_pe, seg, latent: LatentCache) -> torch.Tensor:
        """Up-projected MHA for one request's dense prefill rows (SDPA, bottom-right causal mask).
        Its workspace (the up-projected K/V, the keys, V padded) is bounded by the plan."""
        c = self.config
        h, s = self.num_heads, seg.num_keys
        # [S', 576]: the keys' rows, padded with slot 0 to a multiple of GEMM_ROW_ALIGN for the GEMM
        slots = F.pad(seg.slots.long(), (0, gemm_rows(s, False) - s))
        rows = gather_latent_rows(latent.data, slots, q_nope.dtype)
        kv = F.linear(rows[:, :c.kv_lora_rank], self.kv_b_proj.weight)[:s].view(s, h, -1)
        rows = rows[:s]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat((k_nope, rows[:, None, c.kv_lora_rank:].expand(s, h, c.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [Q, H, 192]
        if v.shape[-1] != k.shape[-1]:  # equal head dims let SDPA pick a fused kernel instead of the math path
            v = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, len, D]: 4-D for the fused kernels
        with sdpa_kernel(MHA_SDPA_BACKENDS):  # not cuDNN: it keeps a plan per shape (MHA_SDPA_BACKENDS)
            if not seg.pos0:  # no prefix: top-left and bottom-right causal alignment coincide
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            else:  # query i at pos0 + i sees keys 0 .. pos0 + i: bottom-right causal, no mask tensor (flash
                # attention takes it as is; a materialized mask would send it to the efficient kernel). Imported
                # here: torch.nn.attention.bias imports torch._dynamo (~2.5 s a process, every `dsa serve`'s)
                from torch.nn.attention.bias import causal_lower_right
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(seg.num_rows, s),
                                                   scale=self.softmax_scale)
        return o[0, ..., :c.v_head_dim].transpose(0, 1)
