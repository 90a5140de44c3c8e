"""indexer_logits_paged: decode-row indexer logits over the paged FP8 key cache.

Ids outside their range read nothing: a position whose block id (``block_table[b, pos // P]``) is
outside ``[0, NB)``, or whose page is past the block table, is invalid (``-inf``), on every backend,
without a host sync.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import deepgemm
from .common import (
    check_block_size,
    check_int,
    check_same_device,
    check_tensor,
    compute_dtype,
    resolve_backend,
    sm_count,
)
from .layouts import INDEXER_SCALE_BYTES, indexer_cache_views


def _paged_keys(index_cache, block_table_row, positions, block_size, dtype):
    """Keys and scales of one request at ``positions`` (all inside its block table), and whether each
    position's block id is in ``[0, NB)``: keys of the others are zeros, never read."""
    blocks = block_table_row.long()[positions // block_size]
    ok = (blocks >= 0) & (blocks < index_cache.shape[0])
    blocks = torch.where(ok, blocks, 0)
    offsets = positions % block_size
    if index_cache.dtype == torch.uint8:  # FP8 planar cache
        k8, scale = indexer_cache_views(index_cache, block_size)
        k, k_scale = k8[blocks, offsets].to(dtype), scale[blocks, offsets].to(dtype)
        return k.masked_fill(~ok[:, None], 0), k_scale.masked_fill(~ok, 0), ok
    return index_cache[blocks, offsets].to(dtype).masked_fill(~ok[:, None], 0), None, ok  # exact [NB, P, DI]


def _width(seq_lens, max_seq_len):
    """``max_seq_len``, or ``max(seq_lens)`` (0 for an empty batch or no positive length: a host sync)."""
    if max_seq_len is not None:
        return max_seq_len
    return max(0, int(seq_lens.max())) if seq_lens.numel() else 0


def indexer_logits_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len=None):
    b, n, hi, di = q8.shape
    width = _width(seq_lens, max_seq_len)
    dt = compute_dtype(q8, weights, index_cache if index_cache.is_floating_point() else None)
    logits = torch.full((b * n, width), float("-inf"), dtype=torch.float32, device=q8.device)
    lengths = seq_lens.tolist()
    chunk = max(1, (1 << 24) // max(1, n * hi))  # bounds the [N, HI, chunk] temporaries
    for r in range(b):
        # causal: query j of request r sees positions [0, S_r - N + j]
        visible = min(lengths[r], width, block_table.shape[1] * block_size) if index_cache.shape[0] else 0
        q = q8[r].to(dt)  # [N, HI, DI]
        w = weights[r].to(dt)  # [N, HI]
        for s0 in range(0, visible, chunk):
            pos = torch.arange(s0, min(visible, s0 + chunk), device=q8.device)
            k, k_scale, ok = _paged_keys(index_cache, block_table[r], pos, block_size, dt)  # [C, DI], [C], [C]
            score = torch.einsum("nh,nhc->nc", w, torch.relu(torch.einsum("nhd,cd->nhc", q, k)))
            if k_scale is not None:
                score = score * k_scale
            last = lengths[r] - n + torch.arange(n, device=q8.device)  # [N] last visible position
            score = torch.where(ok[None, :] & (pos[None, :] <= last[:, None]), score, float("-inf"))
            logits[r * n:(r + 1) * n, s0:s0 + len(pos)] = score.float()
    return logits


@triton.jit
def _group_queries(q_ptr, w_ptr, b, g, N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                   HI_PAD: tl.constexpr, D: tl.constexpr):
    """``q_t [D, G_PAD * HI_PAD]`` e4m3 (K-contiguous) and ``w [G_PAD * HI_PAD]`` fp32 of query tokens
    ``[g*G, g*G + G)`` of request b: row m = (token m // HI_PAD, head m % HI_PAD), zero past G and HI."""
    m = tl.arange(0, G_PAD * HI_PAD)
    jj, h = m // HI_PAD, m % HI_PAD
    j = g * G + jj
    q_ok = (jj < G) & (j < N) & (h < HI)
    q_row = (b * N + j) * HI + h  # [M] int64
    d = tl.arange(0, D)
    q = tl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=q_ok[:, None], other=0.0)  # [M, D] e4m3
    w = tl.load(w_ptr + q_row, mask=q_ok, other=0.0)  # [M] fp32
    return tl.trans(q), w


@triton.jit
def _tile_logits(k, k_scale, q_t, w, BLOCK_S: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr):
    """``sum_h w[h] * relu(k . q[h]) * k_scale`` of a key tile ``k [BLOCK_S, D]``: ``[BLOCK_S, G_PAD]`` fp32
    (one FP8 dot, the head sum in the dot layout's order; both paged kernels score the same way)."""
    score = tl.dot(k, q_t)  # [BLOCK_S, G_PAD * HI_PAD] fp32
    score = tl.maximum(score, 0.0) * w[None, :]
    return tl.sum(tl.reshape(score, [BLOCK_S, G_PAD, HI_PAD]), axis=2) * k_scale[:, None]


@triton.jit
def _program_rows(q_ptr, w_ptr, lens_ptr, width, num_table_blocks, N: tl.constexpr, HI: tl.constexpr,
                  G: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """Program ``(b * groups + g, split)`` of both paged kernels: query tokens ``[g*G, g*G + G)`` of
    request b. Returns b, their queries ``q_t`` and weights ``w`` (``_group_queries``), which of the
    ``G_PAD`` output rows exist, each row's last visible position and start in the logits, and the end
    of the positions any of them sees inside the block table (past it: -inf)."""
    GROUPS: tl.constexpr = (N + G - 1) // G
    pid = tl.program_id(0)
    b = (pid // GROUPS).to(tl.int64)
    g = pid % GROUPS
    seq_len = tl.load(lens_ptr + b)
    q_t, w = _group_queries(q_ptr, w_ptr, b, g, N, HI, G, G_PAD, HI_PAD, D)
    # outputs: token jg of the group sees positions [0, seq_len - N + g*G + jg]
    jg = tl.arange(0, G_PAD)
    row_ok = (jg < G) & (g * G + jg < N)
    last = seq_len - N + g * G + jg  # [G_PAD]
    out_row = (b * N + g * G + jg) * width  # [G_PAD] int64
    group_end = tl.minimum(seq_len - N + tl.minimum(g * G + G, N), num_table_blocks * P)  # past it: -inf
    return b, q_t, w, row_ok, last, out_row, group_end


@triton.jit
def _store_logits(out_ptr, out_row, row_ok, last, pos, s_end, key_ok, logit):
    """Store a tile's ``logit [BLOCK_S, G_PAD]`` at positions ``pos``: -inf where the key is not ``key_ok``
    or past a row's last visible position; nothing past ``s_end`` or for rows that do not exist."""
    logit = tl.where(key_ok[:, None] & (pos[:, None] <= last[None, :]), logit, float("-inf"))
    tl.store(out_ptr + out_row[None, :] + pos[:, None], logit, mask=row_ok[None, :] & (pos < s_end)[:, None])


@triton.jit
def _store_minus_inf(out_ptr, out_row, row_ok, s_begin, s_end, first_tile, tiles_per_prog, BLOCK_S: tl.constexpr,
                     G_PAD: tl.constexpr):
    """-inf on the program's tiles ``[first_tile, tiles_per_prog)`` (past every row's visible positions)."""
    minus_inf = tl.full([BLOCK_S, G_PAD], float("-inf"), tl.float32)
    for tile in range(first_tile, tiles_per_prog):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(out_ptr + out_row[None, :] + pos[:, None], minus_inf, mask=row_ok[None, :] & (pos < s_end)[:, None])


@triton.jit
def _block_ids(table_row, pos, end, P: tl.constexpr):
    """int64 block ids of positions ``pos``; -1 from ``end`` on (never read)."""
    return tl.load(table_row + pos // P, mask=pos < end, other=-1).to(tl.int64)


@triton.jit
def _scales_ahead(table_row, scale_base, block_next, pos_next, end, stride_block, num_blocks, P: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """The pointer kernel's prefetch step: the key scales of positions ``pos_next`` (block ids
    ``block_next``; 0 for an id outside ``[0, num_blocks)``), then the next tile's positions and block ids."""
    k_scale = tl.load(scale_base + block_next * (stride_block // 4) + pos_next % P,
                      mask=(block_next >= 0) & (block_next < num_blocks), other=0.0)
    pos_next += BLOCK_S
    return k_scale, pos_next, _block_ids(table_row, pos_next, end, P)


@triton.jit(do_not_specialize=["stride_table", "num_table_blocks", "num_blocks", "width", "tiles_per_prog"],
            do_not_specialize_on_alignment=["w_ptr", "table_ptr", "lens_ptr"])
def _indexer_logits_paged_kernel(q_ptr, w_ptr, val_ptr, scale_ptr, table_ptr, lens_ptr, out_ptr, stride_block,
                                 stride_table, num_table_blocks, num_blocks, width, tiles_per_prog,
                                 N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                                 HI_PAD: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    # program (b * groups + g, split): query tokens [g*G, g*G + G) of request b (all their heads: the
    # dot's N dim) against key tiles [split * tiles_per_prog, ...) of BLOCK_S positions (its M dim).
    # Each key record is read once per group (once per request when G == N). stride_block: bytes
    # per cache block (a multiple of 4); the fp32 view of the cache indexes it in words. A position whose
    # block id is outside [0, num_blocks) reads nothing and is -inf. Any P (a multiple of 16).
    b, q_t, w, row_ok, last, out_row, group_end = _program_rows(q_ptr, w_ptr, lens_ptr, width, num_table_blocks,
                                                                N, HI, G, G_PAD, HI_PAD, P, D)
    d = tl.arange(0, D)
    s_begin = tl.program_id(1) * tiles_per_prog * BLOCK_S
    s_end = tl.minimum(s_begin + tiles_per_prog * BLOCK_S, width)
    compute_end = tl.maximum(tl.minimum(group_end, s_end), s_begin)
    compute_tiles = tl.cdiv(compute_end - s_begin, BLOCK_S)
    table_row = table_ptr + b * stride_table
    scale_base = scale_ptr + (P * D // 4)  # word offset of a block's scales
    # Key scales are prefetched one tile ahead and their block ids two ahead: Triton pipelines only
    # the loads that feed the dot, and a plain load in the loop would expose the HBM latency.
    pos_next = s_begin + tl.arange(0, BLOCK_S)
    block_next = _block_ids(table_row, pos_next, compute_end, P)
    k_scale_next, pos_next, block_next = _scales_ahead(table_row, scale_base, block_next, pos_next, compute_end,
                                                       stride_block, num_blocks, P, BLOCK_S)
    for tile in range(0, compute_tiles):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        block = _block_ids(table_row, pos, compute_end, P)
        key_ok = (block >= 0) & (block < num_blocks)  # also False past compute_end
        k = tl.load(val_ptr + (block * stride_block + (pos % P) * D)[:, None] + d[None, :], mask=key_ok[:, None],
                    other=0.0, eviction_policy="evict_first")  # [BLOCK_S, D] e4m3, read once
        k_scale = k_scale_next  # [BLOCK_S] fp32
        k_scale_next, pos_next, block_next = _scales_ahead(table_row, scale_base, block_next, pos_next, compute_end,
                                                           stride_block, num_blocks, P, BLOCK_S)
        logit = _tile_logits(k, k_scale, q_t, w, BLOCK_S, G_PAD, HI_PAD)  # [BLOCK_S, G_PAD]
        _store_logits(out_ptr, out_row, row_ok, last, pos, s_end, key_ok, logit)
    _store_minus_inf(out_ptr, out_row, row_ok, s_begin, s_end, compute_tiles, tiles_per_prog, BLOCK_S, G_PAD)


@triton.jit(do_not_specialize=["stride_table", "num_table_blocks", "num_blocks", "width", "tiles_per_prog"],
            do_not_specialize_on_alignment=["w_ptr", "table_ptr", "lens_ptr"])
def _indexer_logits_paged_tma_kernel(q_ptr, w_ptr, val_desc, scale_desc, table_ptr, lens_ptr, out_ptr, stride_table,
                                     num_table_blocks, num_blocks, width, tiles_per_prog,
                                     N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                                     HI_PAD: tl.constexpr, P: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
    # _indexer_logits_paged_kernel with one cache block a tile (BLOCK_S = P), read by TMA from the
    # views [NB, P, D] e4m3 (val_desc) and [NB, P] fp32 (scale_desc): a block id outside [0, NB)
    # reads zeros (TMA's out-of-bounds fill) and its positions are -inf. The block id of the next
    # tile is loaded one iteration ahead, so Triton's pipeliner keeps STAGES - 1 tiles in flight.
    b, q_t, w, row_ok, last, out_row, group_end = _program_rows(q_ptr, w_ptr, lens_ptr, width, num_table_blocks,
                                                                N, HI, G, G_PAD, HI_PAD, P, D)
    page0 = tl.program_id(1) * tiles_per_prog
    s_begin = page0 * P
    s_end = tl.minimum(s_begin + tiles_per_prog * P, width)
    compute_end = tl.maximum(tl.minimum(group_end, s_end), s_begin)
    compute_tiles = tl.cdiv(compute_end - s_begin, P)
    table_row = table_ptr + b * stride_table
    block_next = tl.load(table_row + page0, mask=s_begin < compute_end, other=-1)
    for tile in tl.range(0, compute_tiles, num_stages=STAGES):
        block = block_next
        block_next = tl.load(table_row + page0 + tile + 1, mask=s_begin + (tile + 1) * P < compute_end, other=-1)
        pos = s_begin + tile * P + tl.arange(0, P)  # [P]
        k = tl.reshape(val_desc.load([block, 0, 0]), [P, D])  # [P, D] e4m3, zeros outside [0, NB)
        k_scale = tl.reshape(scale_desc.load([block, 0]), [P])  # [P] fp32
        logit = _tile_logits(k, k_scale, q_t, w, P, G_PAD, HI_PAD)  # [P, G_PAD]
        key_ok = (block >= 0) & (block < num_blocks) & (pos < compute_end)
        _store_logits(out_ptr, out_row, row_ok, last, pos, s_end, key_ok, logit)
    _store_minus_inf(out_ptr, out_row, row_ok, s_begin, s_end, compute_tiles, tiles_per_prog, P, G_PAD)


def _paged_config(n: int, hi: int) -> tuple[int, int, int, int, int]:
    """(G, G_PAD, HI_PAD, BLOCK_S, num_warps): query tokens per program so that the dot's N dim
    G_PAD * HI_PAD stays <= 256 (one wgmma); 128-key tiles for N dims up to 64, else 64 (measured on
    the H200 in wave 2, before the TMA kernel and its sweep below: 171 vs 178 us at B=64, S=64K, N=1;
    266 vs 280 us at N=2), with 4 warps while the fp32
    score tile fits 64 registers a thread."""
    hi_pad = max(16, triton.next_power_of_2(hi))
    g = n if triton.next_power_of_2(n) * hi_pad <= 256 else max(1, 256 // hi_pad)
    g_pad = triton.next_power_of_2(g)
    m = g_pad * hi_pad
    block_s = 128 if m <= 64 else 64
    return g, g_pad, hi_pad, block_s, 4 if block_s * m <= 8192 else 8


def _tma_ok(index_cache, block_size: int, di: int) -> bool:
    """Whether the TMA kernel reads this cache: P = 64 (a block is a tile whose dot has the warp layout
    of the pointer kernel's tiles, so the same head-sum order), DI in 64, 128
    (one swizzled row), a 16-byte aligned cache with at least one block."""
    return block_size == 64 and di in (64, 128) and index_cache.shape[0] > 0 and index_cache.data_ptr() % 16 == 0


def _indexer_logits_paged_triton(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len, *,
                                 tma=None, stages=None, max_tiles=16, waves=4):
    """The launch. Tuning knobs (private; ``dsa bench indexer --variants`` sweeps them): ``tma``
    (None: where ``_tma_ok``), ``stages`` (pipeline depth; None: 4 with TMA, else 3), ``max_tiles``
    (key tiles a program at most) and ``waves`` (programs per SM to aim for). None of them changes a
    bit of the result: every kernel scores a position with the same dot layout and head-sum order.
    The defaults won the H200 sweep (benchmarks/results/indexer-logits-sweep-h200-2026-12-01.json,
    graph replay): 153 us at B=64, S=64K (the pointer kernel 194), 285 at 128K (369), 174 at N=2
    (277), 13.3 at B=1, S=128K (15.0)."""
    b, n, hi, di = q8.shape
    width = _width(seq_lens, max_seq_len)  # None: a host sync
    logits = torch.empty((b * n, width), dtype=torch.float32, device=q8.device)
    if b * n == 0 or width == 0:
        return logits
    q8, weights = q8.contiguous(), weights.contiguous()
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    g, g_pad, hi_pad, block_s, num_warps = _paged_config(n, hi)
    tma = _tma_ok(index_cache, block_size, di) if tma is None else tma
    block_s = block_size if tma else block_s
    programs = b * triton.cdiv(n, g)
    tiles = triton.cdiv(width, block_s)
    # enough programs to fill the GPU `waves` times over, at most `max_tiles` tiles each (fixed by shapes)
    tiles_per_prog = max(1, min(max_tiles, tiles * programs // (waves * sm_count(q8.device))))
    grid = (programs, triton.cdiv(tiles, tiles_per_prog))
    shape = dict(N=n, HI=hi, G=g, G_PAD=g_pad, HI_PAD=hi_pad, P=block_size, D=di)
    # one variant per (shape, tma, stages): the one int that specializes is stride_block (P * (DI + 4) bytes,
    # fixed by the model). The table's stride and width, NB, the width W and tiles_per_prog change per step:
    # runtime values (the logits' row starts are then not known to be 16-byte aligned, so their stores are
    # not vectorized); the weights, block table and seq_lens (views of the step's plan at any offset) are
    # not specialized on their alignment either.
    if tma:
        nb, p = index_cache.shape[0], block_size
        val = TensorDescriptor(index_cache.view(torch.float8_e4m3fn), [nb, p, di], [p * (di + 4), di, 1], [1, p, di])
        scale = index_cache.view(torch.float32)[:, p * di // 4:]
        scale = TensorDescriptor(scale, [nb, p], [p * (di + 4) // 4, 1], [1, p])
        _indexer_logits_paged_tma_kernel[grid](
            q8, weights, val, scale, block_table, seq_lens, logits, block_table.stride(0), block_table.shape[1], nb,
            width, tiles_per_prog, **shape, STAGES=stages or 4, num_warps=num_warps)
        return logits
    _indexer_logits_paged_kernel[grid](
        q8, weights, index_cache.view(torch.float8_e4m3fn), index_cache.view(torch.float32), block_table, seq_lens,
        logits, index_cache.stride(0), block_table.stride(0), block_table.shape[1], index_cache.shape[0], width,
        tiles_per_prog, **shape, BLOCK_S=block_s, num_warps=num_warps, num_stages=stages or 3)
    return logits


def _check_paged_args(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len):
    """The argument checks of ``indexer_logits_paged``:
    ``(block_size, max_seq_len, exact, device)``, ``exact`` for a floating-point (exact) cache."""
    check_tensor("q8", q8, shape=4)
    b, n, hi, di = q8.shape
    block_size = check_block_size(block_size)
    check_tensor("weights", weights, dtype=torch.float32, shape=(b, n, hi))
    check_tensor("index_cache", index_cache)
    exact = index_cache.is_floating_point()
    if exact:
        check_tensor("index_cache", index_cache, shape=(None, block_size, di))
        check_tensor("q8", q8, dtype=(torch.bfloat16, torch.float32, torch.float64))
    else:
        check_tensor("index_cache", index_cache, dtype=torch.uint8,
                     shape=(None, block_size * (di + INDEXER_SCALE_BYTES)))
        check_tensor("q8", q8, dtype=torch.float8_e4m3fn)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(b, None))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(b,))
    if max_seq_len is not None:
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=0)
    device = check_same_device(q8=q8, weights=weights, index_cache=index_cache, block_table=block_table,
                               seq_lens=seq_lens)
    return block_size, max_seq_len, exact, device


def _check_triton_limits(q8, index_cache) -> None:
    """What the paged Triton kernels take: ``1 <= HI <= 128``, ``DI`` in 32..256, a contiguous cache."""
    hi, di = q8.shape[2:]
    if not 1 <= hi <= 128 or di not in (32, 64, 128, 256):
        raise ValueError(f"q8: the Triton kernel takes 1 <= HI <= 128 and DI in 32, 64, 128, 256; got shape "
                         f"{list(q8.shape)}")
    if not index_cache.is_contiguous():
        raise ValueError(f"index_cache: the Triton kernel reads a contiguous cache; got strides {index_cache.stride()}")


def indexer_logits_paged(q8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         max_seq_len: int | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Indexer logits of decode rows against each request's paged keys.

    Args:
        q8: ``[B, N, HI, DI]`` float8_e4m3fn queries (from ``indexer_query_prep``); for an
            exact-precision cache, the unquantized queries in a float dtype.
        weights: ``[B, N, HI]`` float32, the head weights with the query scales folded in.
        index_cache: ``uint8 [NB, P * (DI + 4)]`` planar FP8 cache, or an exact cache
            ``[NB, P, DI]`` (bfloat16/float32/float64, reference only).
        block_table: ``[B, MB]`` int32, block ids of each request's positions; an id outside
            ``[0, NB)`` is read as no block (its positions are ``-inf``).
        seq_lens: ``[B]`` int32, ``S`` of each request (its new ``N`` tokens included); any value.
        block_size: ``P``.
        max_seq_len: output width ``W``; ``max(0, max(seq_lens))`` when None (a host sync; 0 when B=0).

    Returns:
        ``logits [B * N, W]`` float32: row ``b * N + j`` holds
        ``sum_h weights[h] * relu(q8[h] . k8[s]) * k_scale[s]`` on ``[0, seq_lens[b] - N + j]``
        and ``-inf`` elsewhere: past the block table and in blocks whose id is outside ``[0, NB)``
        too. B, N or W = 0 give an empty ``[B * N, W]``; NB = 0 gives all ``-inf``.

    The Triton kernel (CUDA, FP8 cache; ``1 <= HI <= 128``, ``DI`` in 32..256, ``P`` a multiple
    of 16, a contiguous cache) reads each key record once per request and scores it against all
    ``N * HI`` query rows with one FP8 ``tl.dot``; with ``P = 64`` (``DI`` 64 or 128) it reads a
    cache block a tile by TMA, ids outside ``[0, NB)`` as TMA's zero fill. With ``max_seq_len``
    given it never syncs the host (CUDA graphs). Logits match the reference to fp32 summation order.

    ``backend="deepgemm"`` (only when asked, never by ``"auto"``; ``kernels/deepgemm.py`` gives its
    Hopper limits) runs DeepGEMM's ``fp8_paged_mqa_logits`` with the same contract and another
    summation order, without a host sync.
    """
    block_size, max_seq_len, exact, device = _check_paged_args(q8, weights, index_cache, block_table, seq_lens,
                                                               block_size, max_seq_len)
    if backend == "deepgemm":
        if exact:
            raise TypeError("indexer_logits_paged: backend='deepgemm' takes an FP8 cache and FP8 queries")
        return deepgemm.logits_paged(q8, weights, index_cache, block_table, seq_lens, block_size,
                                     _width(seq_lens, max_seq_len))
    impl = resolve_backend(backend, device, "indexer_logits_paged", triton_dtypes_ok=not exact, block_size=block_size)
    if impl == "torch":
        return indexer_logits_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size,
                                              max_seq_len)
    _check_triton_limits(q8, index_cache)
    return _indexer_logits_paged_triton(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len)
