"""indexer_topk_paged: decode-row indexer logits and their top-k, as slots, without the logits tensor.

The same function as ``indexer_logits_paged`` followed by ``topk_slots`` (the reference is that
pair), fused for decode: the logits are scored tile by tile exactly as ``indexer_logits_paged``
scores them (same tiles, same accumulation order, so the same fp32 bits) and only the candidates
of each row are kept, never the ``[B * N, W]`` logits.

Four launches and a memset (the sample's tickets), using the machinery of ``topk`` (guess, verify,
refine):

1. ``_sample_kernel``: for each row, the logits of ``SAMPLE`` positions spread over its window
   (the columns ``topk``'s guess reads), then the guess ``(lo, shift)`` from them;
2. ``_fused_kernel``: the paged-logits grid; each program appends its positions with
   ``key >= lo`` to its region of the row's candidate buffer and stores their bin histogram as
   the region's;
3. ``topk``'s ``_place_kernel``: each region's candidates above the k-th value's bin to the
   output, those in it to the region's front;
4. ``_finish_kernel``: per row, the best of the bin's list, or, if fewer than k positions reached
   ``lo``, the whole window scored again and its k best. Either way the set is the unfused pair's.
"""
import torch
import triton
import triton.language as tl

from .common import TRITON_INTERPRET, check_int, resolve_backend, sm_count
from .indexer_logits_paged import (_check_paged_args, _check_triton_limits, _group_queries, _paged_config,
                                   _tile_logits, indexer_logits_paged_reference)
from .topk import topk_slots_reference
from .topk_select import (_INT_MIN, _MAX_FAST_REGIONS, _SEG, _Z, _finish_fast, _finish_tiles, _gather_fronts,
                          _guess_from_sample, _key, _place_kernel, _refine, _region_hist, _row_selection,
                          _store_positions)

_SAMPLE = 1024  # sample positions per row (the guess's)
_SAMPLE_TILE = 128  # sample positions per program
_HBLOCK = 256  # region histogram steps, smaller than topk's: they share the registers of the scoring loop
_SBLOCK = 256
_LBLOCK = 512


def indexer_topk_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size, k, max_seq_len=None):
    """``topk_slots`` of ``indexer_logits_paged``: row ``b * N + j`` keeps the k best of positions
    ``[0, min(S_b - N + j + 1, W))`` (its causal window; -inf logits inside it, past the block
    table, are candidates like any value), as slots of request ``b``, -1 padded."""
    b, n = q8.shape[:2]
    logits = indexer_logits_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len)
    j = torch.arange(n, device=q8.device)
    lengths = (seq_lens.long()[:, None] - n + 1 + j).clamp(0, logits.shape[1]).view(-1).to(torch.int32)
    row_to_req = torch.arange(b, device=q8.device, dtype=torch.int32).repeat_interleave(n)
    return topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size)


@triton.jit
def _sample_kernel(q_ptr, w_ptr, val_ptr, scale_ptr, table_ptr, lens_ptr, smp_ptr, guess_ptr, ticket_ptr,
                   stride_block, stride_table, num_table_blocks, num_blocks, width, k,
                   N: tl.constexpr, HI: tl.constexpr, HI_PAD: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   SB: tl.constexpr, SAMPLE: tl.constexpr, SEG: tl.constexpr, Z: tl.constexpr):
    # program (row, part): the logits of sample positions [part * SB, part * SB + SB) of the row's
    # window; the row's last part to finish turns the whole sample into the guess (lo, shift).
    PARTS: tl.constexpr = SAMPLE // SB
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    b = row // N
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b) - N + row % N + 1, 0), width)
    if n > k:
        h = tl.arange(0, HI_PAD)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (row * HI + h)[:, None] * D + d[None, :], mask=(h < HI)[:, None], other=0.0)
        w = tl.load(w_ptr + row * HI + h, mask=h < HI, other=0.0)
        i = part * SB + tl.arange(0, SB)
        pos = tl.minimum((i // SEG).to(tl.int64) * n // (SAMPLE // SEG) + i % SEG, n - 1)
        inside = pos < num_table_blocks * P
        block = tl.load(table_ptr + b * stride_table + pos // P, mask=inside, other=0).to(tl.int64)
        ok = inside & (block >= 0) & (block < num_blocks)
        k8 = tl.load(val_ptr + (block * stride_block + (pos % P) * D)[:, None] + d[None, :], mask=ok[:, None],
                     other=0.0)
        k_scale = tl.load(scale_ptr + (P * D // 4) + block * (stride_block // 4) + pos % P, mask=ok, other=0.0)
        score = tl.maximum(tl.dot(k8, tl.trans(q)), 0.0) * w[None, :]  # [SB, HI_PAD]
        logit = tl.where(ok, tl.sum(score, 1) * k_scale, float("-inf"))
        tl.store(smp_ptr + row * SAMPLE + i, logit)
        tl.debug_barrier()  # every thread's sample is written before the ticket releases it
        if tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel") == PARTS - 1:
            x = tl.load(smp_ptr + row * SAMPLE + tl.arange(0, SAMPLE), cache_modifier=".cg")
            lo, shift = _guess_from_sample(_key(x) ^ _INT_MIN, n, k, SAMPLE, Z)
            tl.store(guess_ptr + row * 4, lo)
            tl.store(guess_ptr + row * 4 + 1, shift)


@triton.jit
def _append_cols(region, cnt, key, pos, sel):
    """Append, per column g, the selected ``(key, position)`` of ``key/sel [BS, G]`` at
    ``region[g] + cnt[g]...`` in position order; returns the new counts ``[G]``."""
    rank = tl.cumsum(sel.to(tl.int32), 0)
    packed = (key.to(tl.int64) << 32) | pos.to(tl.int64)[:, None]
    tl.store(region[None, :] + cnt[None, :] + rank - 1, packed, mask=sel)
    return cnt + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _score_tile(val_ptr, scale_base, table_row, pos, inside, q_t, w, stride_block, num_blocks, d,
                BLOCK_S: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """Logits ``[BLOCK_S, G_PAD]`` of positions ``pos`` (indexer_logits_paged's arithmetic) and
    which of them are readable (inside, block id in ``[0, NB)``)."""
    block = tl.load(table_row + pos // P, mask=inside, other=-1).to(tl.int64)
    ok = inside & (block >= 0) & (block < num_blocks)
    k = tl.load(val_ptr + (block * stride_block + (pos % P) * D)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    k_scale = tl.load(scale_base + block * (stride_block // 4) + pos % P, mask=ok, other=0.0)
    return _tile_logits(k, k_scale, q_t, w, BLOCK_S, G_PAD, HI_PAD), ok


@triton.jit
def _fused_kernel(q_ptr, w_ptr, val_ptr, scale_ptr, table_ptr, lens_ptr, guess_ptr, out_ptr, stride_o,
                  cand_ptr, stride_c, cnt_ptr, hist_ptr, logits_ptr,
                  stride_block, stride_table, num_table_blocks, num_blocks, width, k, tiles_per_prog, splits,
                  N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr,
                  P: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, HBLOCK: tl.constexpr,
                  LBLOCK: tl.constexpr, LOGITS: tl.constexpr):
    # program (b * groups + g, split): query tokens [g*G, g*G + G) of request b against key tiles
    # [split * tiles_per_prog, ...), as _indexer_logits_paged_kernel; row r = b*N + j keeps its
    # candidates in region `split` of cand[r] (capacity tiles_per_prog * BLOCK_S: the span) and
    # their bin histogram in hist[r, split].
    # LOGITS (tests): also store the scored logits to logits_ptr [B * N, width].
    GROUPS: tl.constexpr = (N + G - 1) // G
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // GROUPS).to(tl.int64)
    g = pid % GROUPS
    seq_len = tl.load(lens_ptr + b)
    q_t, w = _group_queries(q_ptr, w_ptr, b, g, N, HI, G, G_PAD, HI_PAD, D)
    d = tl.arange(0, D)
    jg = tl.arange(0, G_PAD)
    row_ok = (jg < G) & (g * G + jg < N)
    last = seq_len - N + g * G + jg  # [G_PAD] last visible position
    n_row = tl.minimum(tl.maximum(last + 1, 0), width)  # [G_PAD] the row's window
    rows = b * N + g * G + jg  # [G_PAD] int64
    sel_row = row_ok & (n_row > k)
    lo = tl.load(guess_ptr + rows * 4, mask=sel_row, other=0)
    span = tiles_per_prog * BLOCK_S
    region = cand_ptr + rows * stride_c + split * span  # [G_PAD] pointers
    cnt = tl.zeros([G_PAD], tl.int32)
    group_end = tl.minimum(seq_len - N + tl.minimum(g * G + G, N), num_table_blocks * P)  # past it: -inf
    s_begin = split * span
    s_end = tl.minimum(s_begin + span, width)
    compute_end = tl.maximum(tl.minimum(group_end, s_end), s_begin)
    compute_tiles = tl.cdiv(compute_end - s_begin, BLOCK_S)
    table_row = table_ptr + b * stride_table
    scale_base = scale_ptr + (P * D // 4)  # word offset of a block's scales
    # indexer_logits_paged's loop: key scales prefetched one tile ahead, block ids two ahead
    pos_next = s_begin + tl.arange(0, BLOCK_S)
    block_next = tl.load(table_row + pos_next // P, mask=pos_next < compute_end, other=-1).to(tl.int64)
    k_scale_next = tl.load(scale_base + block_next * (stride_block // 4) + pos_next % P,
                           mask=(pos_next < compute_end) & (block_next >= 0) & (block_next < num_blocks), other=0.0)
    pos_next += BLOCK_S
    block_next = tl.load(table_row + pos_next // P, mask=pos_next < compute_end, other=-1).to(tl.int64)
    for tile in range(0, compute_tiles):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        block = tl.load(table_row + pos // P, mask=pos < compute_end, other=-1).to(tl.int64)
        ok = (pos < compute_end) & (block >= 0) & (block < num_blocks)
        k8 = tl.load(val_ptr + (block * stride_block + (pos % P) * D)[:, None] + d[None, :], mask=ok[:, None],
                     other=0.0, eviction_policy="evict_first")  # [BLOCK_S, D] e4m3, read once
        k_scale = k_scale_next  # [BLOCK_S] fp32
        k_scale_next = tl.load(scale_base + block_next * (stride_block // 4) + pos_next % P,
                               mask=(pos_next < compute_end) & (block_next >= 0) & (block_next < num_blocks),
                               other=0.0)
        pos_next += BLOCK_S
        block_next = tl.load(table_row + pos_next // P, mask=pos_next < compute_end, other=-1).to(tl.int64)
        logit = _tile_logits(k8, k_scale, q_t, w, BLOCK_S, G_PAD, HI_PAD)  # [BLOCK_S, G_PAD]
        logit = tl.where(ok[:, None] & (pos[:, None] <= last[None, :]), logit, float("-inf"))
        if LOGITS:
            tl.store(logits_ptr + rows[None, :] * width + pos[:, None], logit,
                     mask=row_ok[None, :] & (pos < s_end)[:, None])
        key = _key(logit)
        sel = sel_row[None, :] & (pos[:, None] < n_row[None, :]) & (key >= lo[None, :])
        cnt = _append_cols(region, cnt, key, pos, sel)
    key_inf = _key(tl.full([BLOCK_S, G_PAD], float("-inf"), tl.float32))  # positions past the table
    for tile in range(compute_tiles, tiles_per_prog):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)
        sel = sel_row[None, :] & (pos[:, None] < n_row[None, :]) & (key_inf >= lo[None, :])
        cnt = _append_cols(region, cnt, key_inf, pos, sel)
    tl.debug_barrier()  # the regions are written before this program reads them back
    for jr in range(0, G):
        r = b * N + g * G + jr
        n_r = tl.minimum(tl.maximum(seq_len - N + g * G + jr + 1, 0), width)
        if (g * G + jr < N) & (n_r > k):
            c = tl.sum(tl.where(jg == jr, cnt, 0), 0)
            h_r = _region_hist(cand_ptr + r * stride_c + split * span, c, tl.load(guess_ptr + r * 4),
                               tl.load(guess_ptr + r * 4 + 1), HBLOCK)
            tl.store(hist_ptr + (r * splits + split) * 256 + tl.arange(0, 256), h_r)
            tl.store(cnt_ptr + r * splits + split, c)
        elif (g * G + jr < N) & (split == 0):  # a dense row: positions 0 .. n-1, as slots, then -1
            idx = tl.arange(0, LBLOCK)
            for j0 in range(0, k, LBLOCK):
                pos = j0 + idx
                _store_positions(out_ptr + r * stride_o, pos, tl.where(pos < n_r, pos, -1), pos < k, table_row,
                                 seq_len, num_table_blocks, P, True)


@triton.jit
def _finish_kernel(q_ptr, w_ptr, val_ptr, scale_ptr, table_ptr, lens_ptr, guess_ptr, out_ptr, stride_o,
                   cand_ptr, stride_c, cnt_ptr, stride_block, stride_table, num_table_blocks, num_blocks, width, k,
                   splits, span,
                   N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr,
                   P: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, FAST: tl.constexpr, CB: tl.constexpr,
                   W: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row), once the row is placed (topk's _place_kernel): the bin-b list's best, or, if
    # fewer than k positions reached the guess, the whole window scored again (with its group's
    # query tile, as the scoring pass: the same bits) and its k best.
    r = tl.program_id(0).to(tl.int64)
    b = r // N
    jrow = r % N
    seq_len = tl.load(lens_ptr + b)
    n_r = tl.minimum(tl.maximum(seq_len - N + jrow + 1, 0), width)
    if n_r > k:
        fronts_row = cnt_ptr + r * splits
        cand_row = cand_ptr + r * stride_c
        table_row = table_ptr + b * stride_table
        out_row = out_ptr + r * stride_o
        lo, shift, b_r, rem = _row_selection(guess_ptr, r)
        done = False
        if FAST:
            done = _finish_fast(cand_row, fronts_row, splits, span, k, b_r, rem, lo, shift, out_row, table_row, seq_len,
                                num_table_blocks, P, True, CB, W)
        if not done:
            _finish_slow(q_ptr, w_ptr, val_ptr, scale_ptr, cand_row, fronts_row, out_row, table_row, lo, shift, b_r, rem,
                         b, jrow,
                         seq_len, n_r, stride_block, num_table_blocks, num_blocks, k, splits, span,
                         N, HI, G, G_PAD, HI_PAD, P, D, BLOCK_S, CB, W, SBLOCK, LBLOCK)


@triton.jit
def _finish_slow(q_ptr, w_ptr, val_ptr, scale_ptr, cand_row, fronts_row, out_row, table_row, lo, shift, b_r, rem,
                 b, jrow,
                 seq_len, n_r, stride_block, num_table_blocks, num_blocks, k, splits, span,
                 N: tl.constexpr, HI: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HI_PAD: tl.constexpr,
                 P: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, CB: tl.constexpr, W: tl.constexpr,
                 SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    """The finish of a row ``_finish_fast`` did not finish: the bin's list gathered in steps, or
    the whole window scored again (with its group's query tile, as the scoring pass: the same
    bits) and its k best."""
    ok = b_r >= 0
    if ok:
        n_list = _gather_fronts(cand_row, fronts_row, splits, span, CB, W, LBLOCK)
    else:
        g = jrow // G
        jr = jrow % G
        q_t, w = _group_queries(q_ptr, w_ptr, b, g, N, HI, G, G_PAD, HI_PAD, D)
        d = tl.arange(0, D)
        jg = tl.arange(0, G_PAD)
        last = seq_len - N + g * G + jg
        group_end = tl.minimum(seq_len - N + tl.minimum(g * G + G, N), num_table_blocks * P)
        scale_base = scale_ptr + (P * D // 4)
        last_r = seq_len - N + jrow
        for s0 in range(0, n_r, BLOCK_S):
            pos = s0 + tl.arange(0, BLOCK_S)
            logit, ok_t = _score_tile(val_ptr, scale_base, table_row, pos, pos < group_end, q_t, w,
                                      stride_block, num_blocks, d, BLOCK_S, G_PAD, HI_PAD, P, D)
            logit = tl.where(ok_t[:, None] & (pos[:, None] <= last[None, :]), logit, float("-inf"))
            x = tl.sum(tl.where(jg[None, :] == jr, logit, 0.0), 1)
            x = tl.where(pos <= last_r, x, float("-inf"))
            tl.store(cand_row + pos, (_key(x).to(tl.int64) << 32) | pos.to(tl.int64), mask=pos < n_r)
        n_list = n_r.to(tl.int32)
    _refine(cand_row, n_list, ok, b_r, rem, k, lo, shift, out_row, table_row, seq_len, num_table_blocks, P, True,
            SBLOCK, LBLOCK)


def _indexer_topk_paged_triton(q8, weights, index_cache, block_table, seq_lens, block_size, k, max_seq_len, *,
                               sample=_SAMPLE, maxnreg=None, scratch=None, logits=None):
    """Four launches and a memset. ``sample`` (a power of two >= 16), ``maxnreg`` (None: the
    launcher's choice; 0: none), ``scratch`` (a dict that receives the row histograms) and
    ``logits`` (``[B * N, W]`` fp32 that receives the logits of the positions scored in the
    first pass) for tests and tuning."""
    b, n, hi, di = q8.shape
    width = int(seq_lens.max()) if max_seq_len is None else max_seq_len  # None: a host sync
    rows = b * n
    device = q8.device
    slots = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return slots
    if width == 0:
        return slots.fill_(-1)
    q8, weights = q8.contiguous(), weights.contiguous()
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    val, scale = index_cache.view(torch.float8_e4m3fn), index_cache.view(torch.float32)
    g, g_pad, hi_pad, block_s, num_warps = _paged_config(n, hi)
    groups = triton.cdiv(n, g)
    tiles = triton.cdiv(width, block_s)
    # as indexer_logits_paged, but at most _MAX_FAST_REGIONS regions a row, so each row finishes in registers
    tiles_per_prog = max(1, min(16, tiles * b * groups // (4 * sm_count(device))), triton.cdiv(tiles, _MAX_FAST_REGIONS))
    splits = triton.cdiv(tiles, tiles_per_prog)
    span = tiles_per_prog * block_s
    i32 = dict(dtype=torch.int32, device=device)
    smp_tickets = torch.zeros(rows, **i32)  # the sample's parts
    guess = torch.empty((rows, 4), **i32)  # lo, shift (sample); b or -1, rem (place)
    smp = torch.empty((rows, sample), dtype=torch.float32, device=device)
    hist = torch.empty((rows, splits, 256), **i32)  # every entry of a row with n > k written by its program
    cnt = torch.empty((rows, splits), **i32)
    cand = torch.empty((rows, splits * span), dtype=torch.int64, device=device)
    common = (index_cache.stride(0), block_table.stride(0), block_table.shape[1], index_cache.shape[0], width, k)
    if scratch is not None:
        scratch.update(hist=hist)
    sb = min(_SAMPLE_TILE, sample)
    _sample_kernel[(rows, sample // sb)](
        q8, weights, val, scale, block_table, seq_lens, smp, guess, smp_tickets, *common,
        N=n, HI=hi, HI_PAD=hi_pad, P=block_size, D=di, SB=sb, SAMPLE=sample, SEG=_SEG, Z=_Z, num_warps=4)
    if maxnreg is None:  # the histogram code must not cost the scoring loop its occupancy (measured with ptxas)
        maxnreg = 128 if g_pad == 1 else 160
    opts = dict(maxnreg=maxnreg) if maxnreg and not TRITON_INTERPRET else {}
    shape = dict(N=n, HI=hi, G=g, G_PAD=g_pad, HI_PAD=hi_pad, P=block_size, D=di, BLOCK_S=block_s)
    _fused_kernel[(b * groups, splits)](
        q8, weights, val, scale, block_table, seq_lens, guess, slots, slots.stride(0),
        cand, cand.stride(0), cnt, hist, slots if logits is None else logits, *common, tiles_per_prog, splits,
        **shape, HBLOCK=_HBLOCK, LBLOCK=_LBLOCK, LOGITS=logits is not None, num_warps=num_warps, num_stages=3,
        **opts)
    table = (block_table, block_table.stride(0), seq_lens, seq_lens, b, block_table.shape[1], block_size)
    _place_kernel[(rows, splits)](
        seq_lens, seq_lens, width, slots, slots.stride(0), cand, cand.stride(0), cnt, hist, guess, *table, k, splits,
        span, HAS_STARTS=False, SLOTS=True, ROW_DIV=n, LBLOCK=_LBLOCK, num_warps=4)
    fast, cb, w = _finish_tiles(k, width, sample, splits)
    _finish_kernel[(rows,)](
        q8, weights, val, scale, block_table, seq_lens, guess, slots, slots.stride(0), cand, cand.stride(0), cnt,
        *common, splits, span, **shape, FAST=fast, CB=cb, W=w, SBLOCK=_SBLOCK, LBLOCK=_LBLOCK, num_warps=num_warps)
    return slots


def indexer_topk_paged(q8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int, k: int, max_seq_len: int | None = None, *,
                       backend: str = "auto") -> torch.Tensor:
    """The top-k slots of decode rows' indexer logits, without the logits tensor.

    Args:
        q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len: as
            :func:`indexer_logits_paged` (FP8 cache ``uint8 [NB, P * (DI + 4)]``; ``W`` the logits
            width, ``int(seq_lens.max())`` when None: a host sync).
        k: positions to keep per row (``index_topk``).

    Returns:
        ``slots [B * N, k]`` int32: for row ``b * N + j``, the slots of the k best positions of
        ``[0, min(S_b - N + j + 1, W))`` by the logits ``indexer_logits_paged`` computes (bit for
        bit: the same tiles and accumulation order), chosen by ``topk_slots``' rule (ties to the
        lowest positions, NaN by its bits), -1 padded; a window of at most k positions is all of
        it, in order. Positions past the block table or in a block outside ``[0, NB)`` score
        -inf and map to slots as ``topk_slots`` maps them.

    The Triton path (CUDA, HI <= 128, DI in 32..256, P a multiple of 16, a contiguous cache) never
    writes the ``[B * N, W]`` logits; with ``max_seq_len`` given it never syncs the host.
    """
    block_size, max_seq_len, exact, device = _check_paged_args(q8, weights, index_cache, block_table, seq_lens,
                                                               block_size, max_seq_len)
    k = check_int("k", k, minimum=1)
    impl = resolve_backend(backend, device, "indexer_topk_paged", triton_dtypes_ok=not exact, block_size=block_size)
    if impl == "torch":
        return indexer_topk_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size, k,
                                            max_seq_len)
    _check_triton_limits(q8, index_cache)
    return _indexer_topk_paged_triton(q8, weights, index_cache, block_table, seq_lens, block_size, k, max_seq_len)
