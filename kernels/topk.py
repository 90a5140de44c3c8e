"""topk_indices and topk_slots: the best ``k`` columns of each row, as positions or as cache slots.

Selection rule, the same on every backend (the torch reference and the Triton kernel), for any row
width, padding, ``starts`` and batch composition:

- order: fp32 values by their bits (``_order_key``): +NaN above +inf, -NaN below -inf, -0.0 below
  +0.0; equal bit patterns (NaN ones included) tie like any value;
- ties: among values equal to the k-th largest, the lowest positions are selected.

So a row's selection is a function of that row's valid window alone: it does not change with how
far the row is padded, with the other rows of the batch, or with the device.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from .common import check_block_size, check_int, check_same_device, check_tensor, resolve_backend
from .slots import positions_to_slots_reference
from .topk_select import (
    _HBLOCK,
    _LBLOCK,
    _MAX_FAST_REGIONS,
    _SBLOCK,
    _SEG,
    _Z,
    _append,
    _finish_fast,
    _finish_tiles,
    _gather_fronts,
    _guess,
    _key,
    _list_row,
    _place_kernel,
    _refine,
    _region_hist,
    _row_request,
    _row_selection,
    _row_window,
    _store_positions,
)


def _order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[-2**31, 2**31)`` that order like the fp32 values; NaN ranks by its bits
    (+NaN above +inf, -NaN below -inf)."""
    bits = values.float().contiguous().view(torch.int32).long()
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _rank_key(values: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys ``[R, L]`` that order like ``_order_key`` with ties broken by column, the
    lowest column ranking highest: ``key * 2**31 + (2**31 - 1 - column)`` (columns < 2**31)."""
    cols = torch.arange(values.shape[-1], device=values.device)
    return _order_key(values) * (1 << 31) + ((1 << 31) - 1 - cols)


def topk_indices_reference(logits, lengths, k, starts=None):
    """Per row, the positions of the ``min(k, length)`` largest values of its window
    ``logits[r, start : start + length]`` (a negative ``start`` counts as 0, a negative ``length``
    as 0, ``length`` clipped to the row end), ranked by
    ``(_order_key(value), -column)``: the k-th largest value's ties go to the lowest positions.

    Rows with ``length <= k`` are ``0 .. length - 1`` in order; longer rows in descending rank;
    ``-1`` pads every row to ``k``. The keys are distinct, so ``torch.topk`` has no ties to break.
    """
    r, width = logits.shape
    start = torch.zeros(r, dtype=torch.long, device=logits.device) if starts is None else starts.long().clamp_min(0)
    length = torch.minimum(lengths.long(), (width - start).clamp_min(0)).clamp_min(0)  # [R]
    cols = torch.arange(width, device=logits.device)
    valid = (cols >= start[:, None]) & (cols < (start + length)[:, None])
    keys = torch.where(valid, _rank_key(logits), torch.iinfo(torch.int64).min)  # [R, L], distinct where valid
    slot = torch.arange(k, device=logits.device)
    if width >= k:
        best = keys.topk(k, dim=1).indices - start[:, None]  # [R, k] relative positions
    else:
        best = torch.cat((keys.topk(width, dim=1).indices - start[:, None],
                          torch.zeros(r, k - width, dtype=torch.long, device=logits.device)), dim=1)
    short = (length <= k)[:, None]
    positions = torch.where(short, slot[None, :].expand(r, k), best)  # dense rows: 0, 1, ..., length-1
    return torch.where(slot[None, :] < length[:, None], positions, -1).to(torch.int32)


# ---------------------------------------------------------------- Triton: guess, verify, refine
# (the machinery is in topk_select.py)
#
# Three launches, no memset, no atomics. Keys: ``_key`` of the fp32 bits, an int32 whose signed
# order is ``_order_key``'s (NaN by its bits). A row of ``n > k`` columns is cut into C chunks:
#
#   scan    (program per chunk) every program of the row reads the same sample (SAMPLE columns
#           spread over the window) and takes from it a key ``lo`` that, very likely, at least k
#           columns of the row reach, and a bin width ``2**shift`` that cuts the sample's band
#           around the k-th value into ~64 bins (``bin = min((key - lo) >> shift, 255)``). It
#           appends its chunk's columns with ``key >= lo`` (as ``key << 32 | column``, in column
#           order) to its region of the row's candidate buffer (a region holds a whole chunk:
#           nothing can overflow) and stores their bin histogram as the region's;
#   place   (program per chunk) sums the row's region histograms: if at least k candidates exist,
#           the k-th value lies in the bin b found from the top. The program writes its region's
#           candidates above b to the output (at the count of those in the regions before it) and
#           moves those in b to the front of its region, in column order;
#   finish  (program per row) takes the regions' b entries as one list (in column order; usually
#           a [regions, W] tile of their fronts, read in one round trip and kept in registers) and
#           finds their k-th value digit by digit on the bits below the bin; then writes those above
#           it and the first ones equal to it. If fewer than k columns reached ``lo`` (a wrong
#           guess: data built against the sample), it lists the whole row and selects from it the
#           same way: slower, equally exact.
#
# Ties at the k-th value go to the first entries of the list, which is in column order; every
# offset comes from counts summed in a fixed order, so the output is deterministic. The scan reads
# each column once and does a compare and a prefix sum; histograms (``tl.histogram`` lowers to
# warp ballots, ~2 instructions per column) only ever see the sample and the candidates.

_BLOCK = 1024  # scan: columns per step (4 warps x 32 threads x 8 fp32)
_NUM_WARPS = 4
_PROGRAMS = 264  # scan programs per launch the row split aims at (2 per H200 SM)
_MIN_CHUNK = 4096  # columns per program at least: every program pays for the same guess
_SAMPLE = 512  # sample columns per row, read in runs of _SEG (every scan program reads it: the guess)


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
    start, n = _row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    row_l = logits_ptr + r * stride_l + start  # column `pos` of the row's window at row_l + pos
    if n <= k:  # dense row: 0, 1, ..., n - 1, then -1
        if c == 0:
            bt_row, seq_len = _row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS, 0)
            cols = tl.arange(0, BLOCK)
            for j in range(0, k, BLOCK):
                idx = j + cols
                _store_positions(out_ptr + r * stride_o, idx, tl.where(idx < n, idx, -1), idx < k, bt_row, seq_len,
                                 MB, P, SLOTS)
    else:
        chunk = ((n + C - 1) // C + 3) // 4 * 4  # <= CAP
        col_lo = c * chunk
        col_hi = tl.minimum(col_lo + chunk, n)
        pos = col_lo + tl.arange(0, BLOCK)
        x = tl.load(row_l + pos, mask=pos < col_hi, other=0.0)  # two steps' bytes fly during the guess
        x1 = tl.load(row_l + pos + BLOCK, mask=pos + BLOCK < col_hi, other=0.0)
        lo, shift = _guess(row_l, n, k, SAMPLE, SEG, Z)
        region = cand_ptr + r * stride_c + c * CAP
        cnt = 0
        for _j in range(col_lo, col_hi, BLOCK):  # the load two steps ahead is issued before this step's work
            x2 = tl.load(row_l + pos + 2 * BLOCK, mask=pos + 2 * BLOCK < col_hi, other=0.0)
            key = _key(x)
            cnt = _append(region, cnt, key, pos, (pos < col_hi) & (key >= lo))
            pos, x, x1 = pos + BLOCK, x1, x2
        tl.debug_barrier()  # the region is written before this program reads it back
        h = _region_hist(region, cnt, lo, shift, HBLOCK)
        tl.store(hist_ptr + (r * C + c) * 256 + tl.arange(0, 256), h)
        tl.store(cnt_ptr + r * C + c, cnt)
        if c == 0:
            tl.store(guess_ptr + r * 4, lo)
            tl.store(guess_ptr + r * 4 + 1, shift)


@triton.jit(do_not_specialize=["stride_l", "stride_c", "stride_bt", "B", "MB", "L", "C", "CAP"],
            do_not_specialize_on_alignment=["lengths_ptr", "starts_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _finish_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, out_ptr, stride_o, cand_ptr, stride_c, cnt_ptr,
                   guess_ptr, bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, L, k, C, CAP,
                   HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                   CB: tl.constexpr, W: tl.constexpr, SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row), once the row is placed: the bin-b list's best, or the whole row's k best.
    r = tl.program_id(0).to(tl.int64)
    start, n = _row_window(lengths_ptr, starts_ptr, r, L, HAS_STARTS)
    if n > k:
        bt_row, seq_len = _row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS, 0)
        cand_row = cand_ptr + r * stride_c
        out_row = out_ptr + r * stride_o
        lo, shift, b, rem = _row_selection(guess_ptr, r)
        done = False
        if FAST:
            done = _finish_fast(cand_row, cnt_ptr + r * C, C, CAP, k, b, rem, lo, shift, out_row, bt_row, seq_len, MB, P,
                                SLOTS, CB, W)
        if not done:
            if b >= 0:
                n_list = _gather_fronts(cand_row, cnt_ptr + r * C, C, CAP, CB, W, LBLOCK)
            else:
                _list_row(logits_ptr + r * stride_l + start, n, cand_row, BLOCK)
                n_list = n.to(tl.int32)
            _refine(cand_row, n_list, b >= 0, b, rem, k, lo, shift, out_row, bt_row, seq_len, MB, P, SLOTS, SBLOCK,
                    LBLOCK)


def _topk_triton(logits, lengths, k, starts, slots=None, *, block=_BLOCK, programs=_PROGRAMS, min_chunk=_MIN_CHUNK,
                 sample=_SAMPLE, num_warps=_NUM_WARPS, out=None, scratch=None):
    """Three launches. ``slots``: ``(block_table, row_to_req, seq_lens, block_size)`` to write
    slots; ``block``/``programs``/``min_chunk``/``sample``/``num_warps``/``out`` for tests and
    tuning; ``scratch``: a dict that receives the region histograms ``[R, C, 256]``, the region
    counts ``[R, C]`` (after the place kernel: the counts of their bin-b fronts) and the finish
    tile's ``(CB, W)`` (tests)."""
    r, width = logits.shape
    if out is None:
        out = torch.empty((r, k), dtype=torch.int32, device=logits.device)
    if r == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    lengths = lengths.contiguous()
    starts_t = lengths if starts is None else starts.contiguous()
    chunks = max(1, min(triton.cdiv(width, min_chunk), triton.cdiv(programs, r))) if width > k else 1
    cap = triton.cdiv(triton.cdiv(width, chunks), 4) * 4
    i32 = dict(dtype=torch.int32, device=logits.device)
    if width <= k:  # every row is dense: nothing else is read
        hist = cnt = guess = cand = out
    else:
        hist = torch.empty((r, chunks, 256), **i32)  # every entry of a row with n > k written by its program
        cnt = torch.empty((r, chunks), **i32)
        guess = torch.empty((r, 4), **i32)  # lo, shift (scan); b or -1, rem (place)
        cand = torch.empty((r, chunks * cap), dtype=torch.int64, device=logits.device)
    fast, cb, w = _finish_tiles(k, width, sample, chunks)
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
    _scan_kernel[(r, chunks)](
        logits, logits.stride(0), lengths, starts_t, out, out.stride(0), cand, cand.stride(0), cnt, hist, guess,
        *table, width, k, chunks, cap, **flags, BLOCK=block, SAMPLE=sample, SEG=_SEG, Z=_Z, HBLOCK=_HBLOCK,
        num_warps=num_warps)
    if width <= k:
        return out
    _place_kernel[(r, chunks)](
        lengths, starts_t, width, out, out.stride(0), cand, cand.stride(0), cnt, hist, guess, *table, k, chunks, cap,
        **flags, ROW_DIV=0, LBLOCK=_LBLOCK, num_warps=4)
    _finish_kernel[(r,)](
        logits, logits.stride(0), lengths, starts_t, out, out.stride(0), cand, cand.stride(0), cnt, guess, *table,
        width, k, chunks, cap, **flags, BLOCK=block, FAST=fast, CB=cb, W=w, SBLOCK=_SBLOCK, LBLOCK=_LBLOCK,
        num_warps=num_warps)
    return out


def _check_topk_args(logits, lengths, k, starts):
    check_tensor("logits", logits, dtype=torch.float32, shape=2)
    r = logits.shape[0]
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(r,))
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(r,))
    check_int("k", k, minimum=1)
    return check_same_device(logits=logits, lengths=lengths, starts=starts)


def topk_indices(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts: torch.Tensor | None = None, *,
                 backend: str = "auto") -> torch.Tensor:
    """Per row, the ``min(k, length)`` best columns of ``logits[r, start : start + length]``.

    Args:
        logits: ``[R, L]`` float32.
        lengths: ``[R]`` int32, valid columns per row (clipped to ``L - start``; negative: 0).
        k: columns to keep (``index_topk``), an int >= 1 (``k = 0`` is refused).
        starts: ``[R]`` int32 first valid column per row; 0 when None; a negative start is 0.

    Returns:
        ``[R, k]`` int32 positions relative to ``start``, ``-1`` padded at the end of each row.
        A row with ``length <= k`` is exactly ``0, 1, ..., length - 1``. Otherwise the order is
        unspecified and the set is fixed: every selected logit >= every unselected valid one,
        and among logits equal to the k-th largest the lowest positions are selected. Values
        rank by their fp32 bits (+NaN above +inf, -NaN below -inf), so the set is a function
        of the row's window alone: the same at any padding width, in any batch, on any backend.
        Whatever the logits hold, a row holds exactly ``min(k, length)`` distinct in-range
        positions. R = 0 gives ``[0, k]``; L = 0 rows of -1.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    impl = resolve_backend(backend, device, "topk_indices")
    if impl == "torch":
        return topk_indices_reference(logits, lengths, k, starts)
    return _topk_triton(logits, lengths, k, starts)


def finish_tile_shapes(k: int, max_width: int, max_rows: int) -> dict:
    """``{(FAST, CB, W): (rows, width)}``: one logits shape for each finish tile the launcher can
    choose for logits of at most ``[max_rows, max_width]`` (the tile is a constexpr: each is a
    variant to compile). The choice depends on the width and, through the regions per row, on the
    row count; the set is small (powers of two)."""
    shapes = {}
    if max_width <= k:
        return shapes
    widths = np.arange(k + 1, max_width + 1)
    for r in sorted({min(max_rows, n) for n in range(1, _PROGRAMS + 1)}):
        chunks = np.minimum(-(-widths // _MIN_CHUNK), triton.cdiv(_PROGRAMS, r))
        per_region = (k + _Z * np.sqrt(k * widths / _SAMPLE)) / 64 / chunks
        w = np.minimum(_LBLOCK, 2 ** np.ceil(np.log2((2 * per_region).astype(np.int64) + 8))).astype(np.int64)
        cb = np.maximum(1, np.minimum(2 ** np.ceil(np.log2(chunks)).astype(np.int64), _LBLOCK // w))
        fast = (chunks <= cb) & (chunks <= _MAX_FAST_REGIONS)
        for key, i in zip(*np.unique(np.stack((fast, cb, w), 1), axis=0, return_index=True)):
            shapes.setdefault((bool(key[0]), int(key[1]), int(key[2])), (r, int(widths[i])))
    return shapes


def warm_topk_slots(k: int, max_width: int, max_rows: int, block_size: int, device) -> int:
    """Launch :func:`topk_slots` once per finish tile it can choose up to ``[max_rows, max_width]``
    (:func:`finish_tile_shapes`), so a server never compiles one later. Returns the launches."""
    shapes = finish_tile_shapes(k, max_width, max_rows)
    for rows, width in shapes.values():
        logits = torch.randn(rows, width, device=device)
        lengths = torch.full((rows,), width, dtype=torch.int32, device=device)
        table = torch.zeros(1, triton.cdiv(width, block_size), dtype=torch.int32, device=device)
        topk_slots(logits, lengths, k, table, torch.zeros(rows, dtype=torch.int32, device=device), lengths[:1],
                   block_size)
    return len(shapes)


def topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts=None):
    positions = topk_indices_reference(logits, lengths, k, starts)
    return positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)


def topk_slots(logits: torch.Tensor, lengths: torch.Tensor, k: int, block_table: torch.Tensor,
               row_to_req: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
               starts: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """:func:`topk_indices` written straight as cache slots (``positions_to_slots`` fused).

    Args:
        logits, lengths, k, starts: as :func:`topk_indices`.
        block_table: ``[B, MB]`` int32; row_to_req: ``[R]`` int32; seq_lens: ``[B]`` int32.
        block_size: ``P``.

    Returns:
        ``slots [R, k]`` int32: ``block_table[req, pos // P] * P + pos % P`` for each selected
        position, ``-1`` for padding and for whatever :func:`positions_to_slots` cannot map
        (positions outside the request or its block table, rows whose ``row_to_req`` is outside
        ``[0, B)``, negative block ids, slots past int32), on both backends.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    block_size = check_block_size(block_size)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
    check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(logits.shape[0],))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(logits=logits, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
    impl = resolve_backend(backend, device, "topk_slots", block_size=block_size)
    if impl == "torch":
        return topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts)
    return _topk_triton(logits, lengths, k, starts, (block_table, row_to_req, seq_lens, block_size))
