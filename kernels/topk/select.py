"""The exact selection from a list of candidates: the k-th value found 8 bits at a time, then the
entries above it and the first ones equal to it written out (as positions or cache slots).

A list holds ``key << 32 | column`` int64 entries (:func:`~.guess.key_of` keys) in column order, so
the ties at the k-th value that are written are the lowest columns.
"""
import triton
import triton.language as tl

from .guess import INT_MIN, key_of, pick_digit

SBLOCK = 512  # lists up to this length are refined in registers
LBLOCK = 1024  # refine: entries per step


@triton.jit
def store_positions(out_row, idx, pos, mask, bt_row, seq_len, MB, P, SLOTS: tl.constexpr):
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
    store_positions(out_row, out_base + n_gt + (ranks & 65535) - 1, pos, gt, bt_row, seq_len, MB, P, SLOTS)
    store_positions(out_row, out_base + need - rem + eq_rank, pos, eq & (eq_rank < rem), bt_row, seq_len, MB, P,
                    SLOTS)
    counts = tl.max(ranks, 0)
    return n_gt + (counts & 65535), n_eq + (counts >> 16)


@triton.jit
def select_tile(e, m, need, out_base, base, top, prefix, out_row, bt_row, seq_len, MB, P, SLOTS: tl.constexpr):
    """``_select`` of the entries ``e [E]`` (in column order) where ``m``, held in registers."""
    rem = need
    hi_bit = top
    v = (e >> 32) - base
    while hi_bit > 0:
        lo_bit = tl.maximum(hi_bit - 8, 0)
        h = tl.histogram(_digit(v, hi_bit, lo_bit), 256, mask=m & ((v >> hi_bit) == prefix))
        d, rem = pick_digit(h, rem)
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
        select_tile(tl.load(lst + sidx, mask=m, other=0, cache_modifier=".cg"), m, need, out_base, base, top, prefix,
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
            d, rem = pick_digit(h, rem)
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
def list_row(row_l, n, lst, BLOCK: tl.constexpr):
    """List the whole window ``row_l[0:n]`` (the guess failed)."""
    cols = tl.arange(0, BLOCK)
    for j in range(0, n, BLOCK):
        pos = j + cols
        m = pos < n
        key = key_of(tl.load(row_l + pos, mask=m, other=0.0))
        tl.store(lst + pos, (key.to(tl.int64) << 32) | pos.to(tl.int64), mask=m)


@triton.jit
def refine(lst, n_list, ok, b, rem, k, lo, shift, out_row, bt_row, seq_len, MB, P,
           SLOTS: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    """Select from the list the candidates of bin ``b`` still needed (``ok``), or the k best of a
    whole listed row (not ``ok``)."""
    tl.debug_barrier()  # the list is written before it is read
    in_bin = ok & (b < 255)  # the list shares the bits above `shift`
    need = tl.where(ok, rem, k)
    base = tl.where(ok, lo, INT_MIN).to(tl.int64)
    _select(lst, n_list, need, k - need, base, tl.where(in_bin, shift, 32), tl.where(in_bin, b, 0).to(tl.int64),
            out_row, bt_row, seq_len, MB, P, SLOTS, SBLOCK, LBLOCK)
