"""The exact top-k machinery of ``topk`` (``topk_indices`` / ``topk_slots``): the guess from a
sample, candidate regions and their histograms, the place kernel, and the digit-by-digit selection of the k-th value's bin (see topk.py for the scheme).

Keys: ``_key`` of the fp32 bits, an int32 whose signed order is ``topk._order_key``'s (NaN by its
bits). Candidates are ``key << 32 | column`` int64 entries, in column order within a region.
Bins: ``min((key - lo) >> shift, 255)`` for a row's guess ``(lo, shift)``. A row's ``guess`` entry
is ``[lo, shift, b or -1, rem]``: the scan (or the fused op's sample kernel) writes the first two,
the place kernel the last two (``b = -1``: fewer than k candidates reached ``lo``).
"""
import math

import triton
import triton.language as tl

_SEG = 4
_Z = 5.0  # guess margin, in standard deviations of the sample count above the k-th value
_HBLOCK = 512  # candidates per histogram step of a program's own region
_SBLOCK = 512  # lists up to this length are refined in registers
_LBLOCK = 1024  # refine: entries per step
_HREGIONS = tl.constexpr(32)  # region histograms summed per step
_MAX_FAST_REGIONS = 64  # rows of at most this many regions may finish in registers
_INT_MIN = tl.constexpr(-2147483648)  # the lowest key


@triton.jit
def _key(x):
    """fp32 -> int32 whose signed order is ``_order_key``'s (NaN by its bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _pick_digit(h, rem):
    """Digit of the ``rem``-th largest entry from a histogram ``h [256]`` of the entries left.

    Returns ``(d, rem')``: that entry's digit and how many of those still to be found have digit
    ``d`` (``rem`` minus the entries with a digit above ``d``).
    """
    bins = tl.arange(0, 256)
    at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # [256] entries with digit >= bin
    d = tl.minimum(tl.maximum(tl.sum((at_least >= rem).to(tl.int32), 0) - 1, 0), 255)
    return d, rem - tl.sum(tl.where(bins > d, h, 0), 0)


@triton.jit
def _guess_from_sample(u, n, k, SAMPLE: tl.constexpr, Z: tl.constexpr):
    """``(lo, shift)`` from a sample's keys ``u [SAMPLE]`` (``_key ^ INT_MIN``: bits in unsigned
    order) of a row of ``n`` columns: ``lo`` the 16-bit prefix floor of the sample's
    ``m + Z sqrt(m) + 2``-th largest (``m = k * SAMPLE / n``, the sample's expected count at or above
    the row's k-th value), or INT_MIN when that exceeds the sample; ``shift`` such that the sample's
    band down from its ``m - Z sqrt(m)``-th largest to ``lo`` spans fewer than 64 bins."""
    m = k * 1.0 * SAMPLE / n.to(tl.float32)  # k * 1.0: k may arrive as a constexpr (Triton specializes 1)
    spread = Z * tl.sqrt(m)
    m_lo = (m + spread).to(tl.int32) + 2
    m_hi = tl.maximum((m - spread).to(tl.int32), 1)
    top = (u >> 24) & 255
    mid = (u >> 16) & 255
    h = tl.histogram(top, 256)
    a_lo, r_lo = _pick_digit(h, tl.minimum(m_lo, SAMPLE))
    a_hi, r_hi = _pick_digit(h, m_hi)
    h_lo = tl.histogram(mid, 256, mask=top == a_lo)
    b_lo, _r = _pick_digit(h_lo, r_lo)
    h_hi = h_lo
    if a_hi != a_lo:
        h_hi = tl.histogram(mid, 256, mask=top == a_hi)
    b_hi, _r = _pick_digit(h_hi, r_hi)
    lo = ((a_lo << 24) | (b_lo << 16)) ^ _INT_MIN
    lo = tl.where(m_lo > SAMPLE, _INT_MIN, lo)
    hi = ((a_hi << 24) | (b_hi << 16) | 65535) ^ _INT_MIN
    span = (hi.to(tl.int64) - lo.to(tl.int64)).to(tl.float32)  # >= 0; its exponent: floor(log2)
    shift = tl.maximum((span.to(tl.int32, bitcast=True) >> 23) - 127 - 5, 0)
    return lo, shift


@triton.jit
def _guess(row_l, n, k, SAMPLE: tl.constexpr, SEG: tl.constexpr, Z: tl.constexpr):
    """``(lo, shift)`` of a logits row of ``n`` columns at ``row_l`` (see ``_guess_from_sample``)."""
    i = tl.arange(0, SAMPLE)
    pos = tl.minimum((i // SEG).to(tl.int64) * n // (SAMPLE // SEG) + i % SEG, n - 1)
    u = _key(tl.load(row_l + pos)) ^ _INT_MIN
    return _guess_from_sample(u, n, k, SAMPLE, Z)


@triton.jit
def _bins(key, lo, shift):
    return tl.minimum((key.to(tl.int64) - lo) >> shift, 255).to(tl.int32)


@triton.jit
def _append(region, cnt, key, pos, sel):
    """Append the selected ``(key, column)`` pairs, in order, at ``region[cnt:]``; the new count."""
    rank = tl.cumsum(sel.to(tl.int32), 0)
    tl.store(region + cnt + rank - 1, (key.to(tl.int64) << 32) | pos.to(tl.int64), mask=sel)
    return cnt + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _region_hist(region, cnt, lo, shift, HBLOCK: tl.constexpr):
    """Bin histogram of the ``cnt`` entries of ``region`` (written by this program)."""
    idx = tl.arange(0, HBLOCK)
    h = tl.zeros([256], tl.int32)
    for j in range(0, cnt, HBLOCK):
        m = j + idx < cnt
        e = tl.load(region + j + idx, mask=m, other=0, cache_modifier=".cg")  # written by the CTA's other threads
        h += tl.histogram(_bins((e >> 32).to(tl.int32), lo, shift), 256, mask=m)
    return h


@triton.jit
def _store_positions(out_row, idx, pos, mask, bt_row, seq_len, MB, P, SLOTS: tl.constexpr):
    """Write positions (or, with SLOTS, their slots: -1 outside the request or its block table)."""
    if SLOTS:  # positions_to_slots' rule: -1 for what cannot be mapped, negative blocks and int32 overflow too
        page = pos // P
        ok = (pos >= 0) & (pos < seq_len) & (page < MB)
        block = tl.load(bt_row + page, mask=mask & ok, other=-1).to(tl.int64)
        slot = block * P + pos % P
        pos = tl.where(ok & (block >= 0) & (slot <= 2147483647), slot, -1).to(tl.int32)
    tl.store(out_row + idx, pos, mask=mask)


@triton.jit
def _digit(v, hi_bit, lo_bit):
    return ((v >> lo_bit) & ((1 << (hi_bit - lo_bit)) - 1)).to(tl.int32)


@triton.jit
def _write_block(out_row, out_base, need, rem, e, v, m, t, n_gt, n_eq, bt_row, seq_len, MB, P, SLOTS: tl.constexpr):
    """Entries of one block above ``t`` at ``out_base + n_gt...``; the first ``rem`` equal to it
    (over all blocks, in order) at the end of the ``need``."""
    gt = m & (v > t)
    eq = m & (v == t)
    ranks = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # two counts, 16 bits each
    eq_rank = n_eq + (ranks >> 16) - 1
    pos = e.to(tl.int32)
    _store_positions(out_row, out_base + n_gt + (ranks & 65535) - 1, pos, gt, bt_row, seq_len, MB, P, SLOTS)
    _store_positions(out_row, out_base + need - rem + eq_rank, pos, eq & (eq_rank < rem), bt_row, seq_len, MB, P,
                     SLOTS)
    counts = tl.max(ranks, 0)
    return n_gt + (counts & 65535), n_eq + (counts >> 16)


@triton.jit
def _select_tile(e, m, need, out_base, base, top, prefix, out_row, bt_row, seq_len, MB, P, SLOTS: tl.constexpr):
    """``_select`` of the entries ``e [E]`` (in column order) where ``m``, held in registers."""
    rem = need
    hi_bit = top
    v = (e >> 32) - base
    while hi_bit > 0:
        lo_bit = tl.maximum(hi_bit - 8, 0)
        h = tl.histogram(_digit(v, hi_bit, lo_bit), 256, mask=m & ((v >> hi_bit) == prefix))
        d, rem = _pick_digit(h, rem)
        prefix = (prefix << (hi_bit - lo_bit)) | d
        hi_bit = lo_bit
    _write_block(out_row, out_base, need, rem, e, v, m, prefix, 0, 0, bt_row, seq_len, MB, P, SLOTS)


@triton.jit
def _select(lst, n, need, out_base, base, top, prefix, out_row, bt_row, seq_len, MB, P,
            SLOTS: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    """Write the ``need`` best of the ``n`` list entries (``key << 32 | column``, in column order) at
    ``out[out_base:]``. Values ``v = key - base`` in ``[0, 2**32)``, equal to ``prefix`` above bit
    ``top``; the value ``t`` of the need-th best is found 8 bits at a time from bit ``top`` down."""
    rem = need
    hi_bit = top
    if n <= SBLOCK:  # the list in registers
        sidx = tl.arange(0, SBLOCK)
        m = sidx < n
        _select_tile(tl.load(lst + sidx, mask=m, other=0, cache_modifier=".cg"), m, need, out_base, base, top, prefix,
                     out_row, bt_row, seq_len, MB, P, SLOTS)
    else:
        idx = tl.arange(0, LBLOCK)
        while hi_bit > 0:
            lo_bit = tl.maximum(hi_bit - 8, 0)
            h = tl.zeros([256], tl.int32)
            for j in range(0, n, LBLOCK):
                m = j + idx < n
                v = (tl.load(lst + j + idx, mask=m, other=0, cache_modifier=".cg") >> 32) - base
                h += tl.histogram(_digit(v, hi_bit, lo_bit), 256, mask=m & ((v >> hi_bit) == prefix))
            d, rem = _pick_digit(h, rem)
            prefix = (prefix << (hi_bit - lo_bit)) | d
            hi_bit = lo_bit
        n_gt = 0
        n_eq = 0
        for j in range(0, n, LBLOCK):
            m = j + idx < n
            e = tl.load(lst + j + idx, mask=m, other=0, cache_modifier=".cg")
            n_gt, n_eq = _write_block(out_row, out_base, need, rem, e, (e >> 32) - base, m, prefix, n_gt, n_eq,
                                      bt_row, seq_len, MB, P, SLOTS)


@triton.jit
def _list_row(row_l, n, lst, BLOCK: tl.constexpr):
    """List the whole window ``row_l[0:n]`` (the guess failed)."""
    cols = tl.arange(0, BLOCK)
    for j in range(0, n, BLOCK):
        pos = j + cols
        m = pos < n
        key = _key(tl.load(row_l + pos, mask=m, other=0.0))
        tl.store(lst + pos, (key.to(tl.int64) << 32) | pos.to(tl.int64), mask=m)


@triton.jit
def _refine(lst, n_list, ok, b, rem, k, lo, shift, out_row, bt_row, seq_len, MB, P,
            SLOTS: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    """Select from the list the candidates of bin ``b`` still needed (``ok``), or the k best of a
    whole listed row (not ``ok``)."""
    tl.debug_barrier()  # the list is written before it is read
    in_bin = ok & (b < 255)  # the list shares the bits above `shift`
    need = tl.where(ok, rem, k)
    base = tl.where(ok, lo, _INT_MIN).to(tl.int64)
    _select(lst, n_list, need, k - need, base, tl.where(in_bin, shift, 32), tl.where(in_bin, b, 0).to(tl.int64),
            out_row, bt_row, seq_len, MB, P, SLOTS, SBLOCK, LBLOCK)


@triton.jit
def _row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS: tl.constexpr):
    """``(start, n)`` of row ``r``'s window (negative starts and lengths count as 0)."""
    start = 0
    if HAS_STARTS:
        start = tl.maximum(tl.load(starts_ptr + r), 0)
    return start, tl.maximum(tl.minimum(tl.load(lengths_ptr + r), L - start), 0)


@triton.jit
def _row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS: tl.constexpr, ROW_DIV: tl.constexpr):
    """``(block table row, seq_len)`` of row ``r``'s request: ``r // ROW_DIV``, or ``row_to_req[r]``
    when ROW_DIV is 0; a row of no request maps nothing (seq_len 0, the table never read)."""
    bt_row = bt_ptr
    seq_len = 0
    if SLOTS:
        if ROW_DIV == 0:
            req = tl.load(row_to_req_ptr + r).to(tl.int64)
        else:
            req = r // ROW_DIV
        req_ok = (req >= 0) & (req < B)
        req = tl.where(req_ok, req, 0)
        bt_row = bt_ptr + req * stride_bt
        seq_len = tl.load(seq_lens_ptr + req, mask=req_ok, other=0)
    return bt_row, seq_len


@triton.jit
def _row_selection(guess_ptr, r):
    """Row ``r``'s guess record: ``(lo, shift, b, rem)``, ``b = -1`` when fewer than k candidates
    reached ``lo``."""
    g = guess_ptr + r * 4
    return tl.load(g), tl.load(g + 1), tl.load(g + 2), tl.load(g + 3)


@triton.jit
def _threshold(hist_row, C, k, before):
    """From the ``C`` region histograms ``hist_row [C, 256]``: ``(ok, b, rem, n_gt)``, whether at
    least k candidates exist, the bin of the k-th best, how many of bin b are still needed, and
    how many candidates above b the regions before region ``before`` hold."""
    bins = tl.arange(0, 256)
    regions = tl.arange(0, _HREGIONS)
    if C <= _HREGIONS:  # one tile: one round trip
        t = tl.load(hist_row + (regions * 256)[:, None] + bins[None, :], mask=(regions < C)[:, None], other=0)
        h = tl.sum(t, 0)
        b, rem = _pick_digit(h, k)
        n_gt = tl.sum(tl.sum(tl.where((regions < before)[:, None] & (bins > b)[None, :], t, 0), 1), 0)
    else:
        h = tl.zeros([256], tl.int32)
        for c0 in range(0, C, _HREGIONS):
            c = c0 + regions
            h += tl.sum(tl.load(hist_row + (c * 256)[:, None] + bins[None, :], mask=(c < C)[:, None], other=0), 0)
        b, rem = _pick_digit(h, k)
        n_gt = 0
        for c0 in range(0, before, _HREGIONS):
            c = c0 + regions
            t = tl.load(hist_row + (c * 256)[:, None] + bins[None, :], mask=(c < before)[:, None] & (bins > b)[None, :],
                        other=0)
            n_gt += tl.sum(tl.sum(t, 1), 0)
    return tl.sum(h, 0) >= k, b, rem, n_gt


@triton.jit(do_not_specialize=["window", "stride_c", "stride_bt", "B", "MB", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _place_kernel(lengths_ptr, starts_ptr, window, out_ptr, stride_o, cand_ptr, stride_c, cnt_ptr, hist_ptr,
                  guess_ptr, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, k, C, CAP,
                  HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, ROW_DIV: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row, region), once every region of the row is scanned: the region's candidates above
    # the k-th value's bin b to the output, at the count of those in the regions before it; those
    # in b to the front of the region, in column order. Rows: ``_row_window`` of lengths/starts,
    # or (ROW_DIV > 0, decode rows r = req * ROW_DIV + j) ``min(seq_len - ROW_DIV + j + 1, window)``.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bt_row, seq_len = _row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS, ROW_DIV)
    if ROW_DIV == 0:
        _start, n = _row_window(lengths_ptr, starts_ptr, r, window, HAS_STARTS)
    else:
        n = tl.minimum(tl.maximum(seq_len - ROW_DIV + r % ROW_DIV + 1, 0), window)
    if n > k:
        region = cand_ptr + r * stride_c + c * CAP
        idx = tl.arange(0, LBLOCK)
        n_c = tl.load(cnt_ptr + r * C + c)
        e = tl.load(region + idx, mask=idx < CAP, other=0)  # the first step, in flight with the histograms
        lo = tl.load(guess_ptr + r * 4)
        shift = tl.load(guess_ptr + r * 4 + 1)
        ok, b, rem, n_gt = _threshold(hist_ptr + r * C * 256, C, k, c)
        if c == 0:  # the row's selection, for the finish
            tl.store(guess_ptr + r * 4 + 2, tl.where(ok, b, -1))
            tl.store(guess_ptr + r * 4 + 3, rem)
        if ok:
            out_row = out_ptr + r * stride_o
            n_eq = 0
            for j in range(0, n_c, LBLOCK):
                m = j + idx < n_c
                e_next = tl.load(region + j + LBLOCK + idx, mask=m & (j + LBLOCK + idx < n_c), other=0)
                bn = _bins((e >> 32).to(tl.int32), lo, shift)
                gt = m & (bn > b)
                eq = m & (bn == b)
                rank = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # two counts, 16 bits each
                tl.debug_barrier()  # the step is read before the front is overwritten
                _store_positions(out_row, n_gt + (rank & 65535) - 1, e.to(tl.int32), gt, bt_row, seq_len, MB, P,
                                 SLOTS)
                tl.store(region + n_eq + (rank >> 16) - 1, e, mask=eq)
                total = tl.max(rank, 0)
                n_gt += total & 65535
                n_eq += total >> 16
                e = e_next
            tl.store(cnt_ptr + r * C + c, n_eq)  # the region's count is now its front's


@triton.jit
def _gather_fronts(cand_row, fronts_row, C, CAP, CB: tl.constexpr, W: tl.constexpr, LBLOCK: tl.constexpr):
    """Move the bin-b entries at the front of each of the ``C`` regions (``fronts_row[c]`` of them,
    in column order) into one list at ``cand_row[0:]``, regions in order; its length. An
    entry moves to an index below its own and below every later region, so nothing unread is
    overwritten: a tile of CB regions is read whole before it is written, a longer front step by
    step."""
    regions = tl.arange(0, CB)
    cols = tl.arange(0, W)
    idx = tl.arange(0, LBLOCK)
    n_list = 0
    for c0 in range(0, C, CB):
        c = c0 + regions
        e_c = tl.load(fronts_row + c, mask=c < C, other=0)
        dest = n_list + tl.cumsum(e_c, 0) - e_c  # [CB] where each front goes
        if tl.max(e_c, 0) <= W:
            m = cols[None, :] < e_c[:, None]
            t = tl.load(cand_row + (c * CAP)[:, None] + cols[None, :], mask=m, other=0, cache_modifier=".cg")
            tl.debug_barrier()
            tl.store(cand_row + dest[:, None] + cols[None, :], t, mask=m)
        else:
            for ci in range(c0, tl.minimum(c0 + CB, C)):
                e_i = tl.sum(tl.where(regions == ci - c0, e_c, 0), 0)
                d_i = tl.sum(tl.where(regions == ci - c0, dest, 0), 0)
                for j in range(0, e_i, LBLOCK):
                    m = j + idx < e_i
                    t = tl.load(cand_row + ci * CAP + j + idx, mask=m, other=0, cache_modifier=".cg")
                    tl.debug_barrier()
                    tl.store(cand_row + d_i + j + idx, t, mask=m)
        n_list += tl.sum(e_c, 0)
    return n_list


@triton.jit
def _finish_fast(cand_row, fronts_row, C, CAP, k, b, rem, lo, shift, out_row, bt_row, seq_len, MB, P,
                 SLOTS: tl.constexpr, CB: tl.constexpr, W: tl.constexpr):
    """The usual finish, in registers, of a row of at most CB regions (``C <= CB``) whose k-th
    value's bin ``b`` is known (``b >= 0``): the front counts and the regions' first W entries come
    in one round trip, and if every front fits in W, the ``[CB, W]`` tile of fronts (row-major:
    column order) is the list. Returns whether it finished the row."""
    regions = tl.arange(0, CB)
    cols = tl.arange(0, W)
    e_c = tl.load(fronts_row + regions, mask=regions < C, other=0)
    f = tl.load(cand_row + (regions * CAP)[:, None] + cols[None, :], mask=(regions < C)[:, None] & (cols < CAP)[None, :],
                other=0)
    fast = (b >= 0) & (tl.max(e_c, 0) <= W)
    if fast:
        m = tl.reshape((cols[None, :] < e_c[:, None]).to(tl.int32), [CB * W]) != 0
        in_bin = b < 255  # the list shares the bits above `shift`
        _select_tile(tl.reshape(f, [CB * W]), m, rem, k - rem, lo.to(tl.int64), tl.where(in_bin, shift, 32),
                     tl.where(in_bin, b, 0).to(tl.int64), out_row, bt_row, seq_len, MB, P, SLOTS)
    return fast


def _finish_tiles(k, width, sample, chunks):
    """``(FAST, CB, W)``: whether the finish may try ``_finish_fast`` (at most 64 regions), regions
    per tile and entries per region front of a tile, sized for the expected bin-b list (the guess
    band spans < 64 bins) with room to spare."""
    per_region = (k + _Z * math.sqrt(k * width / sample)) / 64 / chunks
    w = min(_LBLOCK, triton.next_power_of_2(int(2 * per_region) + 8))
    cb = max(1, min(triton.next_power_of_2(chunks), _LBLOCK // w))
    return chunks <= cb and chunks <= _MAX_FAST_REGIONS, cb, w
