"""The tile bound of wide rows: a key that at least k columns reach, found from tile maxima, and the
tiles that can hold the row's best k.

A row of ``n`` columns is cut into ``cdiv(n, TILE)`` tiles of TILE columns. If at least k tiles
have a maximum ``>= tau`` (a key), at least k distinct columns reach ``tau``, so the row's k-th
value is ``>= tau``; every column of the best k, and every column tied with the k-th value, then
lies in a tile whose maximum is ``>= tau``. The tightest such ``tau`` is the k-th largest tile
maximum: at 1M columns and k = 2048 it leaves ~2K of 16K tiles and ~2.2K candidate columns, where
the sampled guess of :mod:`.guess` leaves ~16K candidates among all 1M columns.

``_tile_max_kernel`` (program per row chunk) writes each tile's maximum key, over the row's window
only (``INT_MIN`` past it); ``_bound_kernel`` (program per row) finds the k-th largest of them one
bit at a time, its top 16 bits by default (sign, exponent and 7 mantissa bits: a key below ``tau`` by
less than 1%, which lists a few more tiles for half the passes: on the H200 a top-k of 64 x 1M took 183
against 202 us, 409 x 160K 288 against 347), and
lists the tiles reaching it in column order. A row whose k-th largest tile maximum is
``INT_MIN`` (fewer than k tiles hold anything but the lowest NaN) lists every tile with
``lo = INT_MIN``: every column is a candidate, as exact and slower.
"""
import torch
import triton
import triton.language as tl

from .guess import INT_MIN, key_of
from .regions import row_window

TILE = 64  # columns a tile (the launcher picks them by width: launch.bound_tile)
TBLOCK = 16384  # tile maxima a step of the bound kernel (a row of 1M columns in one)
BOUND_WARPS = 16


@triton.jit(do_not_specialize=["stride_l", "stride_t", "L", "CT"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr"])
def _tile_max_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, tmax_ptr, stride_t, L, k, CT,
                    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    # program (row, chunk): the maximum key of each tile of the chunk's tiles; rows of n <= k skip
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start, n = row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    if n > k:
        TPS: tl.constexpr = BLOCK // TILE
        nt = tl.cdiv(n, TILE)
        per = tl.cdiv(tl.cdiv(nt, CT), TPS) * TPS  # tiles a program, whole steps
        t_lo = c * per
        t_hi = tl.minimum(t_lo + per, nt)
        row_l = logits_ptr + r * stride_l + start
        cols = tl.arange(0, BLOCK)
        tiles = tl.arange(0, TPS)
        pos = t_lo * TILE + cols
        x = tl.load(row_l + pos, mask=pos < n, other=0.0)  # one step ahead
        for t0 in range(t_lo, t_hi, TPS):
            x_next = tl.load(row_l + pos + BLOCK, mask=pos + BLOCK < n, other=0.0)
            key = tl.where(pos < n, key_of(x), INT_MIN)
            best = tl.max(tl.reshape(key, [TPS, TILE]), 1)
            tl.store(tmax_ptr + r * stride_t + t0 + tiles, best, mask=t0 + tiles < t_hi)
            pos, x = pos + BLOCK, x_next


@triton.jit(do_not_specialize=["stride_t", "L"], do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr"])
def _bound_kernel(lengths_ptr, starts_ptr, tmax_ptr, stride_t, tlist_ptr, guess_ptr, nsel_ptr, L, k,
                  HAS_STARTS: tl.constexpr, TILE: tl.constexpr, TBLOCK: tl.constexpr, BITS: tl.constexpr):
    # program (row): tau = the k-th largest tile maximum, found bit by bit from the top as the largest
    # key that at least k tiles reach (a count, not a histogram: the tile maxima share their top bits,
    # and a histogram's atomics on one bin serialize); guess[r] = (lo, shift) with lo = tau (its top BITS
    # bits, the bits below clear: a key <= tau) and 2**shift
    # a bin width that cuts [lo, the row's top key] into < 256 bins; the tiles reaching lo, in column
    # order, at tlist[r, :nsel[r]]. A row of up to TBLOCK tiles (1M columns) is one block, read once.
    r = tl.program_id(0).to(tl.int64)
    _start, n = row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    if n > k:
        nt = tl.cdiv(n, TILE)
        row = tmax_ptr + r * stride_t
        idx = tl.arange(0, TBLOCK)
        key = tl.load(row + idx, mask=idx < nt, other=INT_MIN)  # the first block, kept for every bit
        top = tl.max(key, 0)
        for j in range(TBLOCK, nt, TBLOCK):
            top = tl.maximum(top, tl.max(tl.load(row + j + idx, mask=j + idx < nt, other=INT_MIN), 0))
        prefix = tl.zeros([], tl.int32)  # tau's bits found so far, in unsigned order (key ^ INT_MIN)
        for b in tl.static_range(31, 31 - BITS, -1):
            bit = INT_MIN if b == 31 else 1 << b
            cand = (prefix | bit) ^ INT_MIN  # a key: the prefix with bit b set
            count = tl.sum((key >= cand).to(tl.int32), 0)  # masked entries (INT_MIN) lie below every cand
            for j in range(TBLOCK, nt, TBLOCK):
                count += tl.sum((tl.load(row + j + idx, mask=j + idx < nt, other=INT_MIN) >= cand).to(tl.int32), 0)
            prefix = tl.where(count >= k, prefix | bit, prefix)
        lo = prefix ^ INT_MIN  # tau; INT_MIN when fewer than k tiles reach anything higher: every tile listed
        span = (top.to(tl.int64) - lo.to(tl.int64)).to(tl.float32)  # >= 0; its exponent: floor(log2)
        shift = tl.maximum((span.to(tl.int32, bitcast=True) >> 23) - 127 - 7, 0)
        cnt = 0
        for j in range(0, nt, TBLOCK):
            t = j + idx
            sel = (t < nt) & (tl.load(row + t, mask=t < nt, other=INT_MIN) >= lo)
            rank = tl.cumsum(sel.to(tl.int32), 0)
            tl.store(tlist_ptr + r * stride_t + cnt + rank - 1, t, mask=sel)
            cnt += tl.sum(sel.to(tl.int32), 0)
        tl.store(guess_ptr + r * 4, lo)
        tl.store(guess_ptr + r * 4 + 1, shift)
        tl.store(nsel_ptr + r, cnt)


def tile_bound(logits, lengths, starts, has_starts, k, guess, *, tile=TILE, programs=1056, block=1024, num_warps=4,
               bits=32):
    """The tile bound of each row of ``logits [R, L]`` with ``n > k`` (arguments as checked by the
    top-k ops; ``starts`` a tensor even when ``has_starts`` is False): writes ``guess[r, 0:2] = (lo,
    shift)`` and returns ``(tlist [R, cdiv(L, tile)], nsel [R])``, the listed tiles of each row in
    column order and their count. ``programs``: tile-maxima programs the row split aims at; ``bits``:
    how many of tau's top bits to find (fewer: a lower key, the same selection)."""
    r, width = logits.shape
    tiles = triton.cdiv(width, tile)
    i32 = dict(dtype=torch.int32, device=logits.device)
    tmax = torch.empty((r, tiles), **i32)  # every tile of a row with n > k written
    tlist = torch.empty((r, tiles), **i32)
    nsel = torch.empty((r,), **i32)
    ct = max(1, triton.cdiv(programs, r))
    _tile_max_kernel[(r, ct)](logits, logits.stride(0), lengths, starts, tmax, tmax.stride(0), width, k, ct,
                              HAS_STARTS=has_starts, BLOCK=block, TILE=tile, num_warps=num_warps)
    _bound_kernel[(r,)](lengths, starts, tmax, tmax.stride(0), tlist, guess, nsel, width, k, HAS_STARTS=has_starts,
                        TILE=tile, TBLOCK=TBLOCK, BITS=bits, num_warps=BOUND_WARPS)
    return tlist, nsel
