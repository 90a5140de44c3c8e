"""Rows and their candidate regions: a row's window and request, the bin histograms of its regions,
the bin of its k-th value, and the gathering of that bin's entries into one list.

A row of ``n > k`` columns is cut into ``C`` chunks, each with a region of the row's candidate
buffer (``CAP`` entries: a whole chunk) that receives the chunk's candidates, ``key << 32 | column``
in column order. Bins: ``min((key - lo) >> shift, 255)`` for the row's guess ``(lo, shift)``. A row's
``guess`` record is ``[lo, shift, b or -1, rem]``: the scan writes the first two, the place kernel the
last two (``b = -1``: fewer than k candidates reached ``lo``).
"""
import math

import triton
import triton.language as tl

from .guess import Z, pick_digit
from .select import LBLOCK, select_tile

HBLOCK = 512  # candidates per histogram step of a program's own region
MAX_FAST_REGIONS = 64  # rows of at most this many regions may finish in registers
_HREGIONS = tl.constexpr(32)  # region histograms summed per step


@triton.jit
def bin_of(key, lo, shift):
    return tl.minimum((key.to(tl.int64) - lo) >> shift, 255).to(tl.int32)


@triton.jit
def append_candidates(region, cnt, key, pos, sel):
    """Append the selected ``(key, column)`` pairs, in order, at ``region[cnt:]``; the new count."""
    rank = tl.cumsum(sel.to(tl.int32), 0)
    tl.store(region + cnt + rank - 1, (key.to(tl.int64) << 32) | pos.to(tl.int64), mask=sel)
    return cnt + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def region_hist(region, cnt, lo, shift, HBLOCK: tl.constexpr):
    """Bin histogram of the ``cnt`` entries of ``region`` (written by this program)."""
    idx = tl.arange(0, HBLOCK)
    h = tl.zeros([256], tl.int32)
    for j in range(0, cnt, HBLOCK):
        m = j + idx < cnt
        e = tl.load(region + j + idx, mask=m, other=0, cache_modifier=".cg")  # written by the CTA's other threads
        h += tl.histogram(bin_of((e >> 32).to(tl.int32), lo, shift), 256, mask=m)
    return h


@triton.jit
def row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS: tl.constexpr):
    """``(start, n)`` of row ``r``'s window (negative starts and lengths count as 0)."""
    start = 0
    if HAS_STARTS:
        start = tl.maximum(tl.load(starts_ptr + r), 0)
    return start, tl.maximum(tl.minimum(tl.load(lengths_ptr + r), L - start), 0)


@triton.jit
def row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS: tl.constexpr):
    """``(block table row, seq_len)`` of row ``r``'s request ``row_to_req[r]``; a row of no request
    maps nothing (seq_len 0, the table never read)."""
    bt_row = bt_ptr
    seq_len = 0
    if SLOTS:
        req = tl.load(row_to_req_ptr + r).to(tl.int64)
        req_ok = (req >= 0) & (req < B)
        req = tl.where(req_ok, req, 0)
        bt_row = bt_ptr + req * stride_bt
        seq_len = tl.load(seq_lens_ptr + req, mask=req_ok, other=0)
    return bt_row, seq_len


@triton.jit
def row_selection(guess_ptr, r):
    """Row ``r``'s guess record: ``(lo, shift, b, rem)``, ``b = -1`` when fewer than k candidates
    reached ``lo``."""
    g = guess_ptr + r * 4
    return tl.load(g), tl.load(g + 1), tl.load(g + 2), tl.load(g + 3)


@triton.jit
def threshold(hist_row, C, k, before):
    """From the ``C`` region histograms ``hist_row [C, 256]``: ``(ok, b, rem, n_gt)``, whether at
    least k candidates exist, the bin of the k-th best, how many of bin b are still needed, and
    how many candidates above b the regions before region ``before`` hold."""
    bins = tl.arange(0, 256)
    regions = tl.arange(0, _HREGIONS)
    if C <= _HREGIONS:  # one tile: one round trip
        t = tl.load(hist_row + (regions * 256)[:, None] + bins[None, :], mask=(regions < C)[:, None], other=0)
        h = tl.sum(t, 0)
        b, rem = pick_digit(h, k)
        n_gt = tl.sum(tl.sum(tl.where((regions < before)[:, None] & (bins > b)[None, :], t, 0), 1), 0)
    else:
        h = tl.zeros([256], tl.int32)
        for c0 in range(0, C, _HREGIONS):
            c = c0 + regions
            h += tl.sum(tl.load(hist_row + (c * 256)[:, None] + bins[None, :], mask=(c < C)[:, None], other=0), 0)
        b, rem = pick_digit(h, k)
        n_gt = 0
        for c0 in range(0, before, _HREGIONS):
            c = c0 + regions
            t = tl.load(hist_row + (c * 256)[:, None] + bins[None, :], mask=(c < before)[:, None] & (bins > b)[None, :],
                        other=0)
            n_gt += tl.sum(tl.sum(t, 1), 0)
    return tl.sum(h, 0) >= k, b, rem, n_gt


@triton.jit
def gather_fronts(cand_row, fronts_row, C, CAP, CB: tl.constexpr, W: tl.constexpr, LBLOCK: tl.constexpr):
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
def finish_fast(cand_row, fronts_row, C, CAP, k, b, rem, lo, shift, out_row, bt_row, seq_len, MB, P,
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
        select_tile(tl.reshape(f, [CB * W]), m, rem, k - rem, lo.to(tl.int64), tl.where(in_bin, shift, 32),
                    tl.where(in_bin, b, 0).to(tl.int64), out_row, bt_row, seq_len, MB, P, SLOTS)
    return fast


def finish_tiles(k, width, sample, chunks):
    """``(FAST, CB, W)``: whether the finish may try ``finish_fast`` (at most 64 regions), regions
    per tile and entries per region front of a tile, sized for the expected bin-b list (the guess
    band spans < 64 bins) with room to spare."""
    per_region = (k + Z * math.sqrt(k * width / sample)) / 64 / chunks
    w = min(LBLOCK, triton.next_power_of_2(int(2 * per_region) + 8))
    cb = max(1, min(triton.next_power_of_2(chunks), LBLOCK // w))
    return chunks <= cb and chunks <= MAX_FAST_REGIONS, cb, w
