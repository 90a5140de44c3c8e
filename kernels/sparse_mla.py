"""sparse_mla: absorbed MLA over selected rows of the shared 576-wide latent cache.

The Triton kernel here also serves ``dense_mla_decode`` (``DENSE=True``: rows come from the block
table instead of a slot list), so both ops share one tiling, one softmax and one LSE merge.

Ids outside their range read nothing and contribute nothing, on every backend, without a host
sync: a slot outside ``[0, NB * P)`` is skipped like ``-1``, and (dense) a block id outside
``[0, NB)`` makes its positions invisible.
"""
import torch
import triton
import triton.language as tl

from . import sparse_mla_hopper as hopper
from .common import FLOAT_DTYPES, check_real, check_same_device, check_tensor, compute_dtype, resolve_backend
from .layouts import (
    KV_LORA_RANK,
    LATENT_DIM,
    LATENT_FP8_ROPE_OFFSET,
    LATENT_FP8_SCALE_OFFSET,
    LATENT_FP8_TILE,
    latent_cache_format,
    latent_fp8_views,
)
from .mla_split import split_launch


def gather_latent_rows(latent_cache, slots, dtype):
    """Rows ``[..., 576]`` of the cache at ``slots`` (all in ``[0, NB * P)``), dequantized to ``dtype``."""
    flat = latent_cache.view(-1, latent_cache.shape[-1])  # [NB * P, row]: a slot indexes a row
    rows = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, flat.shape[-1])
    if latent_cache_format(latent_cache) != "fp8":
        return rows.to(dtype)
    kv8, scale, k_pe = latent_fp8_views(rows)
    kv = kv8.to(dtype).unflatten(-1, (-1, LATENT_FP8_TILE)) * scale.to(dtype)[..., None]
    return torch.cat((kv.flatten(-2), k_pe.to(dtype)), dim=-1)


def sparse_mla_reference(q, latent_cache, slots, softmax_scale):
    t, h, _ = q.shape
    dt = compute_dtype(q)
    out = torch.empty((t, h, KV_LORA_RANK), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float64 if dt == torch.float64 else torch.float32, device=q.device)
    k = slots.shape[1]
    num_slots = latent_cache.shape[0] * latent_cache.shape[1]
    chunk = max(1, (1 << 24) // max(1, k * LATENT_DIM))  # bounds the gathered [chunk, K, 576] rows
    for t0 in range(0, t, chunk):
        sl = slots[t0:t0 + chunk].long()  # [C, K]
        valid = (sl >= 0) & (sl < num_slots)  # -1 and slots outside the cache are skipped
        if num_slots:
            rows = gather_latent_rows(latent_cache, torch.where(valid, sl, 0), dt)  # [C, K, 576]
            rows.masked_fill_(~valid[..., None], 0)  # rows no slot names never reach the math
        else:
            rows = torch.zeros(*sl.shape, LATENT_DIM, dtype=dt, device=q.device)
        score = torch.einsum("chd,ckd->chk", q[t0:t0 + chunk].to(dt), rows) * softmax_scale
        score = torch.where(valid[:, None, :], score, float("-inf"))
        row_lse = torch.logsumexp(score, dim=-1)  # [C, H], -inf for rows with no valid slot
        p = torch.exp(score - torch.where(torch.isfinite(row_lse), row_lse, 0)[..., None])
        out[t0:t0 + chunk] = torch.einsum("chk,ckd->chd", p, rows[..., :KV_LORA_RANK]).to(q.dtype)
        lse[t0:t0 + chunk] = row_lse.to(lse.dtype)
    return out, lse


_SCALE_OFF = tl.constexpr(LATENT_FP8_SCALE_OFFSET)  # byte offsets inside a 656-byte FP8 row
_ROPE_OFF = tl.constexpr(LATENT_FP8_ROPE_OFFSET)


@triton.jit
def _load_latent_rows(cache_ptr, row_off, valid, FP8: tl.constexpr):
    """Gather rows ``[BLOCK_N, 576]`` as four ``[BLOCK_N, 128]`` kv_c tiles + ``[BLOCK_N, 64]`` k_pe, bf16.

    ``row_off`` [BLOCK_N] int64: element offset (bf16 cache) or byte offset (FP8 cache) of each row;
    rows with ``valid`` False are never read (poisoned rows stay out) and come back as zeros.
    """
    d = tl.arange(0, 128)
    e = tl.arange(0, 64)
    m = valid[:, None]
    if FP8:
        base = cache_ptr + row_off  # [BLOCK_N] uint8 pointers
        sc = (base + _SCALE_OFF).to(tl.pointer_type(tl.float32))  # 4 fp32 scales per row
        pe = (base + _ROPE_OFF).to(tl.pointer_type(tl.bfloat16))
        k0 = tl.load(base[:, None] + d[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k1 = tl.load(base[:, None] + (128 + d)[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k2 = tl.load(base[:, None] + (256 + d)[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k3 = tl.load(base[:, None] + (384 + d)[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k0 = (k0 * tl.load(sc, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
        k1 = (k1 * tl.load(sc + 1, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
        k2 = (k2 * tl.load(sc + 2, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
        k3 = (k3 * tl.load(sc + 3, mask=valid, other=0.0)[:, None]).to(tl.bfloat16)
        kpe = tl.load(pe[:, None] + e[None, :], mask=m, other=0.0)
    else:
        base = cache_ptr + row_off  # [BLOCK_N] bf16 pointers
        k0 = tl.load(base[:, None] + d[None, :], mask=m, other=0.0)
        k1 = tl.load(base[:, None] + (128 + d)[None, :], mask=m, other=0.0)
        k2 = tl.load(base[:, None] + (256 + d)[None, :], mask=m, other=0.0)
        k3 = tl.load(base[:, None] + (384 + d)[None, :], mask=m, other=0.0)
        kpe = tl.load(base[:, None] + (512 + e)[None, :], mask=m, other=0.0)
    return k0, k1, k2, k3, kpe


@triton.jit(do_not_specialize=["ROWS", "N", "K", "MB", "NUM_BLOCKS", "NUM_SLOTS", "TOTAL_ROWS", "SPLIT_LEN",
                               "stride_slots", "stride_bt"],
            do_not_specialize_on_alignment=["slots_ptr", "block_table_ptr", "seq_lens_ptr"])
def _mla_attn_kernel(
        q_ptr, cache_ptr, slots_ptr, block_table_ptr, seq_lens_ptr,  # inputs
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,  # outputs (final, or per split)
        scale_log2,  # softmax_scale * log2(e)
        ROWS, H, N, K, MB, NUM_BLOCKS, NUM_SLOTS, TOTAL_ROWS, SPLIT_LEN,
        stride_slots, stride_bt, stride_cb, stride_cp, block_size,
        DENSE: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: group ``g`` (a token for sparse, a request for dense), ``BLOCK_H`` of its query rows,
    and one split of its key rows; online softmax in the log2 domain, fp32 accumulators. Key rows whose
    slot is outside ``[0, NUM_SLOTS)`` (sparse) or whose block id is outside ``[0, NUM_BLOCKS)``
    (dense) are never read and count as masked."""
    g = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] query rows inside the group
    split = tl.program_id(2)
    row_ok = r < ROWS
    row = g * ROWS + r  # [BLOCK_H] int64 flat query row
    d = tl.arange(0, 128)
    e = tl.arange(0, 64)
    q_row = q_ptr + row[:, None] * 576
    qm = row_ok[:, None]
    q0 = tl.load(q_row + d[None, :], mask=qm, other=0.0)  # [BLOCK_H, 128] bf16
    q1 = tl.load(q_row + (128 + d)[None, :], mask=qm, other=0.0)
    q2 = tl.load(q_row + (256 + d)[None, :], mask=qm, other=0.0)
    q3 = tl.load(q_row + (384 + d)[None, :], mask=qm, other=0.0)
    qpe = tl.load(q_row + (512 + e)[None, :], mask=qm, other=0.0)  # [BLOCK_H, 64] bf16

    if DENSE:
        seq_len = tl.load(seq_lens_ptr + g)
        length = tl.minimum(seq_len, MB * block_size)
        last = seq_len - N + r // H  # [BLOCK_H] last visible position of each row
    else:
        length = K
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, length)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        if DENSE:
            blk = tl.load(block_table_ptr + g * stride_bt + idx // block_size, mask=idx < end, other=-1).to(tl.int64)
            valid = (blk >= 0) & (blk < NUM_BLOCKS)  # also False past `end`
            row_off = blk * stride_cb + (idx % block_size).to(tl.int64) * stride_cp
        else:
            slot = tl.load(slots_ptr + g * stride_slots + idx, mask=idx < end, other=-1)
            valid = (slot >= 0) & (slot < NUM_SLOTS)
            slot = tl.where(valid, slot, 0).to(tl.int64)
            row_off = (slot // block_size) * stride_cb + (slot % block_size) * stride_cp
        k0, k1, k2, k3, kpe = _load_latent_rows(cache_ptr, row_off, valid, FP8)
        s = tl.dot(q0, tl.trans(k0))  # [BLOCK_H, BLOCK_N] fp32
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.dot(qpe, tl.trans(kpe), s)
        if DENSE:
            ok = valid[None, :] & (idx[None, :] <= last[:, None])
        else:
            ok = valid[None, :] & (r >= 0)[:, None]
        s = tl.where(ok, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing valid yet stay at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = p.to(tl.bfloat16)
        acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
        m_i = m_new

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # [BLOCK_H] log2 domain
    if SPLIT:
        o_row = part_out_ptr + (split * TOTAL_ROWS + row)[:, None] * 512
        tl.store(o_row + d[None, :], acc0 * inv[:, None], mask=qm)
        tl.store(o_row + (128 + d)[None, :], acc1 * inv[:, None], mask=qm)
        tl.store(o_row + (256 + d)[None, :], acc2 * inv[:, None], mask=qm)
        tl.store(o_row + (384 + d)[None, :], acc3 * inv[:, None], mask=qm)
        tl.store(part_lse_ptr + split * TOTAL_ROWS + row, lse2, mask=row_ok)
    else:
        o_row = out_ptr + row[:, None] * 512
        tl.store(o_row + d[None, :], (acc0 * inv[:, None]).to(tl.bfloat16), mask=qm)
        tl.store(o_row + (128 + d)[None, :], (acc1 * inv[:, None]).to(tl.bfloat16), mask=qm)
        tl.store(o_row + (256 + d)[None, :], (acc2 * inv[:, None]).to(tl.bfloat16), mask=qm)
        tl.store(o_row + (384 + d)[None, :], (acc3 * inv[:, None]).to(tl.bfloat16), mask=qm)
        tl.store(lse_ptr + row, lse2 * 0.6931471805599453, mask=row_ok)


def _tiles(device: torch.device, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): 64 query rows per program on the GPU (wgmma needs
    M = 64), two warpgroups splitting the 512-wide fp32 accumulator (128 registers a thread); 64 keys a
    tile in 2 stages keeps q (74 KB) and the gathered tiles (2 x 74 KB) in shared memory (measured 23%
    faster than 32 keys in 3 stages for the B=64 sparse decode). 16 x 16 tiles under the interpreter."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    if rows <= 16:
        return 16, 64, 4, 2
    return 64, 64, 8, 2


def mla_attention_triton(q_rows, latent_cache, rows, groups, *, slots=None, block_table=None, seq_lens=None,
                         n=1, h=None, length, softmax_scale, block_n=None, num_stages=None):
    """Launch the shared kernel over ``groups x rows`` query rows ``q_rows [groups * rows, 576]`` bf16.

    Sparse (``slots [groups, K]``): group = token, rows = H. Dense (``block_table``/``seq_lens``):
    group = request, rows = N * H, ``length`` = an upper bound of the context (no host sync).
    Small grids split the key rows over programs (``SPLIT_LEN`` each) and merge them by LSE (``mla_split``).
    Returns ``(out [groups * rows, 512] bf16, lse [groups * rows] fp32)``.
    """
    block_h, bn, warps, stages = _tiles(q_rows.device, rows)
    bn = block_n or bn
    launch = split_launch(q_rows, latent_cache, rows, groups, row_blocks=triton.cdiv(rows, block_h), block_n=bn,
                          granule=1, split_in_keys=True, slots=slots, block_table=block_table, seq_lens=seq_lens,
                          n=n, h=h, length=length, softmax_scale=softmax_scale)
    if launch.grid is not None:
        # one variant per (DENSE, FP8, SPLIT, tiles): the ints that specialize are H (the model's heads), the
        # cache strides and P (fixed by the cache layout; its strides are multiples of 16, for the vectorized
        # row gathers); rows, N, K, MB, NB, the slot count, the total rows, the split length and the slots'
        # and table's strides are runtime values, and the int tables (plan views at any offset) are not
        # specialized on their alignment
        grid = launch.grid
        _mla_attn_kernel[grid](*launch.args, **launch.flags, BLOCK_H=block_h, BLOCK_N=bn, num_warps=warps,
                               num_stages=num_stages or stages)
    return launch.finish()


def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor, softmax_scale: float, *,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends, in the absorbed 576-wide space, to the cache rows its slots name.

    Args:
        q: ``[T, H, 576]`` bfloat16 absorbed queries ``[q_nope @ W_UK_T | q_pe]``
            (float32/float64 through the reference).
        latent_cache: bfloat16 ``[NB, P, 576]``, uint8 ``[NB, P, 656]`` (FP8) or float32
            ``[NB, P, 576]`` (reference only). K is the whole row, V its first 512 values.
        slots: ``[T, K]`` int32 cache slots; a slot outside ``[0, NB * P)`` (``-1``, any negative,
            ``NB * P`` or more) is skipped: never read, no weight. Any ``K``, ``K = 0`` included
            (the kernels pad it to their tile of 16 with skipped slots).
        softmax_scale: multiplies ``q . k`` before the softmax.
        backend: ``"auto"`` (default) runs the Hopper kernel (``sparse_mla_hopper``) on sm_90 when ``H``
            is a multiple of 64, the portable Triton kernel on other CUDA devices, and the reference on
            CPU or for float32 inputs; ``"hopper"``, ``"triton"`` and ``"torch"`` pick one (``"hopper"``
            raises ValueError where it cannot run). The kernels compute the same function.

    Returns:
        ``(out [T, H, 512] q.dtype, lse [T, H] float32)`` with natural-log ``lse``; a row with
        no valid slot (K = 0 too) gives ``out = 0`` and ``lse = -inf``. T = 0 or H = 0 give
        empty outputs of these shapes.
    """
    fmt = latent_cache_format(latent_cache)
    softmax_scale = check_real("softmax_scale", softmax_scale)
    check_tensor("q", q, dtype=FLOAT_DTYPES, shape=(None, None, LATENT_DIM))
    check_tensor("slots", slots, dtype=torch.int32, shape=(q.shape[0], None))
    device = check_same_device(q=q, latent_cache=latent_cache, slots=slots)
    use_hopper = hopper.use_hopper(backend, device, q.shape[1], (latent_cache,))  # raises if "hopper" cannot run
    impl = resolve_backend("triton" if backend == "hopper" else backend, device, "sparse_mla",
                           triton_dtypes_ok=fmt != "fp32" and q.dtype == torch.bfloat16)
    if impl == "torch":
        return sparse_mla_reference(q, latent_cache, slots, float(softmax_scale))
    if slots.shape[1] % 16:  # the kernels take tiles of 16 slots: pad with skipped slots
        slots = torch.nn.functional.pad(slots, (0, 16 - slots.shape[1] % 16), value=-1)
    t, h, k = q.shape[0], q.shape[1], slots.shape[1]
    if latent_cache.stride(2) != 1:
        raise ValueError("latent_cache: expected unit stride along the row (a contiguous last dim)")
    q_rows = q.contiguous().view(t * h, LATENT_DIM)
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    run = hopper.mla_attention_hopper if use_hopper else mla_attention_triton
    out, lse = run(q_rows, latent_cache, h, t, slots=slots, length=k, softmax_scale=softmax_scale)
    return out.view(t, h, KV_LORA_RANK), lse.view(t, h)
