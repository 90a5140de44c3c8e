"""The Triton top-k: guess, verify, refine in three launches (five with the tile bound), no memset, no atomics.

Keys: :func:`~.guess.key_of` of the fp32 bits, an int32 whose signed order is
:func:`~.reference.order_key`'s (NaN by its bits). A row of ``n > k`` columns is cut into C chunks:

  scan    (program per chunk) every program of the row reads the same sample (SAMPLE columns
          spread over the window) and takes from it a key ``lo`` that, very likely, at least k
          columns of the row reach, and a bin width ``2**shift`` that cuts the sample's band
          around the k-th value into ~64 bins (``bin = min((key - lo) >> shift, 255)``). It
          appends its chunk's columns with ``key >= lo`` (as ``key << 32 | column``, in column
          order) to its region of the row's candidate buffer (a region holds a whole chunk:
          nothing can overflow) and stores their bin histogram as the region's;
  place   (program per chunk) sums the row's region histograms: if at least k candidates exist,
          the k-th value lies in the bin b found from the top. The program writes its region's
          candidates above b to the output (at the count of those in the regions before it) and
          moves those in b to the front of its region, in column order;
  finish  (program per row) takes the regions' b entries as one list (in column order; usually
          a [regions, W] tile of their fronts, read in one round trip and kept in registers) and
          finds their k-th value digit by digit on the bits below the bin; then writes those above
          it and the first ones equal to it. If fewer than k columns reached ``lo`` (a wrong
          guess: data built against the sample), it lists the whole row and selects from it the
          same way: slower, equally exact.

Wide logits (:func:`bounded`: 32 rows and 16M logits and more, rows of at least 4k tiles: 128K columns at
k = 2048) replace the guess by the tile bound of :mod:`.bound`, two launches before the scan: ``lo`` is the
k-th largest tile maximum, its top 16 bits (at least k columns reach it, and every column of the best k
lies in a tile whose maximum reaches it), and the scan reads only the tiles listed as reaching ``lo``, ~2K of 16K at 1M
columns, instead of the whole row; place and finish are the same. The tiles are as narrow as the bound
kernel's one step of tile maxima allows (:func:`bound_tile`: 16 columns to 256K, 32 to 512K, 64 to 1M),
so the listed tiles hold ~k x tile columns.

Ties at the k-th value go to the first entries of the list, which is in column order; every
offset comes from counts summed in a fixed order, so the output is deterministic. The scan reads
each column once and does a compare and a prefix sum; histograms (``tl.histogram`` lowers to
warp ballots, ~2 instructions per column) only ever see the sample and the candidates.

:func:`topk_triton` takes its arguments as checked by :func:`~.ops.topk_indices` and
:func:`~.ops.topk_slots` (it checks nothing); its keywords are the tuning knobs of the tests and of
``dsa bench topk --variants``.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from dsa.kernels.common import cdiv

from .bound import TBLOCK, tile_bound
from .guess import SEG, Z, guess_row, key_of
from .regions import (
    HBLOCK,
    MAX_FAST_REGIONS,
    append_candidates,
    bin_of,
    finish_fast,
    finish_tiles,
    gather_fronts,
    region_hist,
    row_request,
    row_selection,
    row_window,
    threshold,
)
from .select import LBLOCK, SBLOCK, list_row, refine, store_positions

BLOCK = 1024  # scan: columns per step (4 warps x 32 threads x 8 fp32)
NUM_WARPS = 4
PROGRAMS = 264  # scan programs per launch the row split aims at (2 per H200 SM)
MIN_CHUNK = 4096  # columns per program at least: every program pays for the same guess
MAX_CHUNKS = 128  # regions a row at most: each place program reads every region's histogram (C^2 reads a row);
# on the H200 a row of 1M takes 34.3 us with 128 regions, 36.9 with 64, 44.8 with 256 (topk-variants-h200-2026-12-03)
SAMPLE = 512  # sample columns per row, read in runs of SEG (every scan program reads it: the guess)
BOUND_TILES = 4  # logits take the tile bound when a row of their width has this many tiles per k at least
BOUND_ROWS = 32  # and they have this many rows at least
BOUND_ELEMS = 1 << 24  # and this many logits at least (the bound kernel's ~60 us a row program, paid once)
BOUND_BITS = 16  # the bound's top bits found: sign, exponent, 7 of the mantissa (32: the k-th tile maximum itself)
MIN_TILE = 16  # the narrowest tiles of the bound (64 bytes of fp32 logits: two sectors)
TILE_PROGRAMS = 1056  # tile-maxima programs per launch the row split aims at (8 per H200 SM)


@triton.jit
def _dense_row(out_ptr, stride_o, r, n, k, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P,
               SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """A row of ``n <= k`` columns: 0, 1, ..., n - 1, then -1."""
    bt_row, seq_len = row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS)
    cols = tl.arange(0, BLOCK)
    for j in range(0, k, BLOCK):
        idx = j + cols
        store_positions(out_ptr + r * stride_o, idx, tl.where(idx < n, idx, -1), idx < k, bt_row, seq_len, MB, P,
                        SLOTS)


@triton.jit(do_not_specialize=["stride_l", "stride_c", "stride_bt", "B", "MB", "L", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _scan_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, out_ptr, stride_o, cand_ptr, stride_c,
                 cnt_ptr, hist_ptr, guess_ptr, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P,
                 L, k, C, CAP,
                 HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                 SEG: tl.constexpr, Z: tl.constexpr, HBLOCK: tl.constexpr):
    # program (row, chunk): the guess, then the chunk's candidates into its region, their bin
    # histogram into hist[row, chunk]; chunk 0 also stores the guess (and writes dense rows).
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start, n = row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    row_l = logits_ptr + r * stride_l + start  # column `pos` of the row's window at row_l + pos
    if n <= k:
        if c == 0:
            _dense_row(out_ptr, stride_o, r, n, k, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, SLOTS,
                       BLOCK)
    else:
        chunk = ((n + C - 1) // C + 3) // 4 * 4  # <= CAP
        col_lo = c * chunk
        col_hi = tl.minimum(col_lo + chunk, n)
        pos = col_lo + tl.arange(0, BLOCK)
        x = tl.load(row_l + pos, mask=pos < col_hi, other=0.0)  # two steps' bytes fly during the guess
        x1 = tl.load(row_l + pos + BLOCK, mask=pos + BLOCK < col_hi, other=0.0)
        lo, shift = guess_row(row_l, n, k, SAMPLE, SEG, Z)
        region = cand_ptr + r * stride_c + c * CAP
        cnt = 0
        for _j in range(col_lo, col_hi, BLOCK):  # the load two steps ahead is issued before this step's work
            x2 = tl.load(row_l + pos + 2 * BLOCK, mask=pos + 2 * BLOCK < col_hi, other=0.0)
            key = key_of(x)
            cnt = append_candidates(region, cnt, key, pos, (pos < col_hi) & (key >= lo))
            pos, x, x1 = pos + BLOCK, x1, x2
        tl.debug_barrier()  # the region is written before this program reads it back
        h = region_hist(region, cnt, lo, shift, HBLOCK)
        tl.store(hist_ptr + (r * C + c) * 256 + tl.arange(0, 256), h)
        tl.store(cnt_ptr + r * C + c, cnt)
        if c == 0:
            tl.store(guess_ptr + r * 4, lo)
            tl.store(guess_ptr + r * 4 + 1, shift)


@triton.jit(do_not_specialize=["stride_l", "stride_c", "stride_t", "stride_bt", "B", "MB", "L", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _scan_tiles_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, out_ptr, stride_o, cand_ptr, stride_c,
                       cnt_ptr, hist_ptr, guess_ptr, tlist_ptr, stride_t, nsel_ptr, bt_ptr, stride_bt, row_to_req_ptr,
                       seq_lens_ptr, B, MB, P, L, k, C, CAP,
                       HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                       HBLOCK: tl.constexpr):
    # the scan of a row with a tile bound (bound.py): program (row, chunk) takes its share of the
    # row's listed tiles (in column order) and appends their columns with key >= lo to its region,
    # then stores the region's bin histogram and count, as _scan_kernel does for a whole chunk.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start, n = row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    if n <= k:
        if c == 0:
            _dense_row(out_ptr, stride_o, r, n, k, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, SLOTS,
                       BLOCK)
    else:
        TPS: tl.constexpr = BLOCK // TILE
        nsel = tl.load(nsel_ptr + r)
        lo = tl.load(guess_ptr + r * 4)
        shift = tl.load(guess_ptr + r * 4 + 1)
        per = tl.cdiv(tl.cdiv(nsel, C), TPS) * TPS  # tiles a program: its region holds per * TILE <= CAP
        j_lo = c * per
        j_hi = tl.minimum(j_lo + per, nsel)
        row_l = logits_ptr + r * stride_l + start
        idx = tl.arange(0, BLOCK)
        region = cand_ptr + r * stride_c + c * CAP
        lists = tlist_ptr + r * stride_t
        # loads in flight ahead of the work: the tile ids two steps ahead, the columns one step ahead
        tj = j_lo + idx // TILE
        pos = tl.load(lists + tj, mask=tj < j_hi, other=0) * TILE + idx % TILE
        m = (tj < j_hi) & (pos < n)
        x = tl.load(row_l + pos, mask=m, other=0.0)
        tile_next = tl.load(lists + tj + TPS, mask=tj + TPS < j_hi, other=0)
        cnt = 0
        for _j in range(j_lo, j_hi, TPS):
            tile_after = tl.load(lists + tj + 2 * TPS, mask=tj + 2 * TPS < j_hi, other=0)
            pos_next = tile_next * TILE + idx % TILE
            m_next = (tj + TPS < j_hi) & (pos_next < n)
            x_next = tl.load(row_l + pos_next, mask=m_next, other=0.0)
            key = key_of(x)
            cnt = append_candidates(region, cnt, key, pos, m & (key >= lo))
            tj, pos, m, x, tile_next = tj + TPS, pos_next, m_next, x_next, tile_after
        tl.debug_barrier()  # the region is written before this program reads it back
        h = region_hist(region, cnt, lo, shift, HBLOCK)
        tl.store(hist_ptr + (r * C + c) * 256 + tl.arange(0, 256), h)
        tl.store(cnt_ptr + r * C + c, cnt)


@triton.jit(do_not_specialize=["window", "stride_c", "stride_bt", "B", "MB", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _place_kernel(lengths_ptr, starts_ptr, window, out_ptr, stride_o, cand_ptr, stride_c, cnt_ptr, hist_ptr,
                  guess_ptr, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, k, C, CAP,
                  HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row, region), once every region of the row is scanned: the region's candidates above
    # the k-th value's bin b to the output, at the count of those in the regions before it; those
    # in b to the front of the region, in column order.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bt_row, seq_len = row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS)
    _start, n = row_window(lengths_ptr, starts_ptr, r, window, HAS_STARTS)
    if n > k:
        region = cand_ptr + r * stride_c + c * CAP
        idx = tl.arange(0, LBLOCK)
        n_c = tl.load(cnt_ptr + r * C + c)
        e = tl.load(region + idx, mask=idx < CAP, other=0)  # the first step, in flight with the histograms
        lo = tl.load(guess_ptr + r * 4)
        shift = tl.load(guess_ptr + r * 4 + 1)
        ok, b, rem, n_gt = threshold(hist_ptr + r * C * 256, C, k, c)
        if c == 0:  # the row's selection, for the finish
            tl.store(guess_ptr + r * 4 + 2, tl.where(ok, b, -1))
            tl.store(guess_ptr + r * 4 + 3, rem)
        if ok:
            out_row = out_ptr + r * stride_o
            n_eq = 0
            for j in range(0, n_c, LBLOCK):
                m = j + idx < n_c
                e_next = tl.load(region + j + LBLOCK + idx, mask=m & (j + LBLOCK + idx < n_c), other=0)
                bn = bin_of((e >> 32).to(tl.int32), lo, shift)
                gt = m & (bn > b)
                eq = m & (bn == b)
                rank = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # two counts, 16 bits each
                tl.debug_barrier()  # the step is read before the front is overwritten
                store_positions(out_row, n_gt + (rank & 65535) - 1, e.to(tl.int32), gt, bt_row, seq_len, MB, P,
                                SLOTS)
                tl.store(region + n_eq + (rank >> 16) - 1, e, mask=eq)
                total = tl.max(rank, 0)
                n_gt += total & 65535
                n_eq += total >> 16
                e = e_next
            tl.store(cnt_ptr + r * C + c, n_eq)  # the region's count is now its front's


@triton.jit(do_not_specialize=["stride_l", "stride_c", "stride_bt", "B", "MB", "L", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _finish_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, out_ptr, stride_o, cand_ptr, stride_c, cnt_ptr,
                   guess_ptr, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, L, k, C, CAP,
                   HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                   CB: tl.constexpr, W: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row), once the row is placed: the bin-b list's best, or the whole row's k best.
    r = tl.program_id(0).to(tl.int64)
    start, n = row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    if n > k:
        bt_row, seq_len = row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS)
        cand_row = cand_ptr + r * stride_c
        out_row = out_ptr + r * stride_o
        lo, shift, b, rem = row_selection(guess_ptr, r)
        done = False
        if FAST:
            done = finish_fast(cand_row, cnt_ptr + r * C, C, CAP, k, b, rem, lo, shift, out_row, bt_row, seq_len, MB, P,
                               SLOTS, CB, W)
        if not done:
            if b >= 0:
                n_list = gather_fronts(cand_row, cnt_ptr + r * C, C, CAP, CB, W, LBLOCK)
            else:
                list_row(logits_ptr + r * stride_l + start, n, cand_row, BLOCK)
                n_list = n.to(tl.int32)
            refine(cand_row, n_list, b >= 0, b, rem, k, lo, shift, out_row, bt_row, seq_len, MB, P, SLOTS, SBLOCK,
                   LBLOCK)


def bound_tile(width: int) -> int:
    """The tile bound's tile for rows of ``width`` columns: the narrowest power of two, ``MIN_TILE`` at
    least, whose tiles of a row are one step (``TBLOCK``) of the bound kernel, which keeps that step in
    registers for every bit (16 columns to 256K, 32 to 512K, 64 to 1M). Narrower tiles list fewer
    columns (~k x tile); more of them than a step reloads the row's maxima at every bit (at 1M: 32 columns
    took 265 us a call, 64 took 200)."""
    return max(MIN_TILE, 1 << (cdiv(width, TBLOCK) - 1).bit_length())


def bounded(rows: int, width: int, k: int, bound_tiles: int = BOUND_TILES, tile: int | None = None,
            bound_rows: int = BOUND_ROWS, bound_elems: int = BOUND_ELEMS) -> bool:
    """Whether ``[rows, width]`` logits take the tile bound (``bound.py``): a row that wide has at least
    ``bound_tiles * k`` tiles of ``tile`` (None: :func:`bound_tile`) columns, and there are ``bound_rows``
    rows and ``bound_elems`` logits at least (the bound kernel is a program per row of ~60 us at any
    width: a decode step of one row at 1M is faster on the sampled guess, whose scan splits the row 256
    ways, and so are 64 rows of 128K, a 64 us call there)."""
    tile = tile or bound_tile(width)
    return width > k and width >= bound_tiles * k * tile and rows >= bound_rows and rows * width >= bound_elems


def bound_widths(k: int, max_width: int, max_rows: int) -> dict:
    """``{tile: (rows, width)}``: one logits shape of at most ``[max_rows, max_width]`` taking the tile
    bound for each tile width :func:`bound_tile` gives to a bounded shape (each a variant of the bound's
    kernels to compile), the fewest rows and columns that take it."""
    shapes, tile = {}, MIN_TILE
    while tile <= bound_tile(max_width):
        width = max(k + 1, BOUND_TILES * k * tile, tile // 2 * TBLOCK + 1 if tile > MIN_TILE else 0)
        rows = max(BOUND_ROWS, cdiv(BOUND_ELEMS, width))
        if width <= max_width and rows <= max_rows and bound_tile(width) == tile and bounded(rows, width, k):
            shapes[tile] = (rows, width)
        tile *= 2
    return shapes


def row_regions(rows: int, width: int, k: int, programs: int = PROGRAMS, min_chunk: int = MIN_CHUNK,
                max_chunks: int = MAX_CHUNKS) -> int:
    """``C``: the regions (scan programs) of each row of ``[rows, width]`` logits: ``programs`` a launch, at
    least ``min_chunk`` columns and at most ``max_chunks`` regions a row; 1 when no row is wider than ``k``."""
    if width <= k:
        return 1
    return max(1, min(triton.cdiv(width, min_chunk), triton.cdiv(programs, rows), max_chunks))


def topk_triton(logits, lengths, k, starts, slots=None, *, block=BLOCK, programs=PROGRAMS, min_chunk=MIN_CHUNK,
                max_chunks=MAX_CHUNKS, sample=SAMPLE, num_warps=NUM_WARPS, bound_tiles=BOUND_TILES,
                bound_rows=BOUND_ROWS, bound_elems=BOUND_ELEMS, bound_bits=BOUND_BITS, tile=None,
                tile_programs=TILE_PROGRAMS, out=None, scratch=None):
    """Three launches, five for logits wide enough for the tile bound (:func:`bounded`: the tile maxima
    and the bound replace the guess, and the scan reads only the listed tiles). ``slots``:
    ``(block_table, row_to_req, seq_lens, block_size)`` to write slots;
    ``block``/``programs``/``min_chunk``/``max_chunks``/``sample``/``num_warps``/``bound_tiles``/``bound_rows``/
    ``bound_elems``/``bound_bits`` (the bound's top bits found: fewer give a lower, equally exact
    bound)/``tile`` (None: :func:`bound_tile`)/``tile_programs``/``out`` for tests and tuning;
    ``scratch``: a dict that receives the region histograms ``[R, C, 256]``, the region counts ``[R, C]``
    (after the place kernel: the counts of their bin-b fronts), the finish tile's ``(CB, W)`` and, on
    the tile bound, the guess records ``[R, 4]`` and the listed tiles per row ``[R]`` (tests)."""
    r, width = logits.shape
    if out is None:
        out = torch.empty((r, k), dtype=torch.int32, device=logits.device)
    if r == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    lengths = lengths.contiguous()
    starts_t = lengths if starts is None else starts.contiguous()
    chunks = row_regions(r, width, k, programs, min_chunk, max_chunks)
    tile = tile or bound_tile(width)
    bound = bounded(r, width, k, bound_tiles, tile, bound_rows, bound_elems)
    tiles = triton.cdiv(width, tile)
    if bound:  # a region holds its program's share of the listed tiles, whole steps of block // tile
        cap = triton.cdiv(triton.cdiv(tiles, chunks), block // tile) * block
    else:
        cap = triton.cdiv(triton.cdiv(width, chunks), 4) * 4
    i32 = dict(dtype=torch.int32, device=logits.device)
    if width <= k:  # every row is dense: nothing else is read
        hist = cnt = guess = cand = out
    else:
        hist = torch.empty((r, chunks, 256), **i32)  # every entry of a row with n > k written by its program
        cnt = torch.empty((r, chunks), **i32)
        guess = torch.empty((r, 4), **i32)  # lo, shift (scan); b or -1, rem (place)
        cand = torch.empty((r, chunks * cap), dtype=torch.int64, device=logits.device)
    fast, cb, w = finish_tiles(k, width, sample, chunks)
    if scratch is not None:
        scratch.update(hist=hist, counts=cnt, tiles=(cb, w))
    if slots is None:
        bt, row_to_req, seq_lens, block_size = out, out, out, 1
    else:
        bt, row_to_req, seq_lens, block_size = slots
        bt, row_to_req, seq_lens = bt.contiguous(), row_to_req.contiguous(), seq_lens.contiguous()
    table = (bt, bt.stride(0), row_to_req, seq_lens, bt.shape[0], bt.shape[1], block_size)
    # one variant per (k, P, flags, tiles) and kernel: the ints that specialize are k, P and stride_o (= k:
    # the output is fresh), fixed by the model; the logits' stride and width, the regions C and their CAP,
    # the candidates' and table's strides, B and MB change per step: runtime values (so the scan's logits
    # loads are not known to be aligned). lengths, starts and the slot tables (plan views at any offset)
    # are not specialized on their alignment.
    flags = dict(HAS_STARTS=starts is not None, SLOTS=slots is not None)
    if bound:
        tlist, nsel = tile_bound(logits, lengths, starts_t, starts is not None, k, guess, tile=tile,
                                 programs=tile_programs, block=block, num_warps=num_warps, bits=bound_bits)
        if scratch is not None:
            scratch.update(guess=guess, listed=nsel)
        _scan_tiles_kernel[(r, chunks)](
            logits, logits.stride(0), lengths, starts_t, out, out.stride(0), cand, cand.stride(0), cnt, hist, guess,
            tlist, tlist.stride(0), nsel, *table, width, k, chunks, cap, **flags, BLOCK=block, TILE=tile,
            HBLOCK=HBLOCK, num_warps=num_warps)
    else:
        _scan_kernel[(r, chunks)](
            logits, logits.stride(0), lengths, starts_t, out, out.stride(0), cand, cand.stride(0), cnt, hist, guess,
            *table, width, k, chunks, cap, **flags, BLOCK=block, SAMPLE=sample, SEG=SEG, Z=Z, HBLOCK=HBLOCK,
            num_warps=num_warps)
    if width <= k:
        return out
    _place_kernel[(r, chunks)](
        lengths, starts_t, width, out, out.stride(0), cand, cand.stride(0), cnt, hist, guess, *table, k, chunks, cap,
        **flags, LBLOCK=LBLOCK, num_warps=4)
    _finish_kernel[(r,)](
        logits, logits.stride(0), lengths, starts_t, out, out.stride(0), cand, cand.stride(0), cnt, guess, *table,
        width, k, chunks, cap, **flags, BLOCK=block, FAST=fast, CB=cb, W=w, SBLOCK=SBLOCK, LBLOCK=LBLOCK,
        num_warps=num_warps)
    return out


def finish_tile_shapes(k: int, max_width: int, max_rows: int) -> dict:
    """``{(FAST, CB, W): (rows, width)}``: one logits shape for each finish tile the launcher can
    choose for logits of at most ``[max_rows, max_width]`` (the tile is a constexpr: each is a
    variant to compile). The choice depends on the width and, through the regions per row, on the
    row count; the set is small (powers of two)."""
    shapes = {}
    if max_width <= k:
        return shapes
    widths = np.arange(k + 1, max_width + 1)
    spans = cdiv(widths, MIN_CHUNK)
    caps = set()  # the row count acts only through the chunk cap: a row count whose cap came before adds no tile
    per_row = (k + Z * np.sqrt(k * widths / SAMPLE)) / 64  # the same for every cap
    for r in sorted({min(max_rows, n) for n in range(1, PROGRAMS + 1)}):
        cap = min(triton.cdiv(PROGRAMS, r), int(spans[-1]), MAX_CHUNKS)  # a cap above every width's span caps none
        if cap in caps:
            continue
        caps.add(cap)
        chunks = np.minimum(spans, cap)
        per_region = per_row / chunks
        # powers of two as shifts (exact, and ~5x faster than ** on 1M widths)
        w = np.minimum(LBLOCK, 1 << np.ceil(np.log2((2 * per_region).astype(np.int64) + 8)).astype(np.int64))
        cb = np.maximum(1, np.minimum(1 << np.ceil(np.log2(chunks)).astype(np.int64), LBLOCK // w))
        fast = (chunks <= cb) & (chunks <= MAX_FAST_REGIONS)
        # a tile's first width is the first or one whose tile differs from the previous width's: np.unique (its
        # order, its first indices) over those alone, not over every width (~0.25 s a cap at 1M columns)
        steps = np.flatnonzero(np.diff((cb << 24 | w << 1 | fast), prepend=-1))
        for key, i in zip(*np.unique(np.stack((fast[steps], cb[steps], w[steps]), 1), axis=0, return_index=True)):
            shapes.setdefault((bool(key[0]), int(key[1]), int(key[2])), (r, int(widths[steps[i]])))
    return shapes
