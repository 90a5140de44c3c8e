"""topk_indices and topk_slots: the best ``k`` columns of each row, as positions or as cache slots.

Selection rule, the same on every backend (the torch reference and the Triton kernel), for any row
width, padding, ``starts`` and batch composition:

- order: fp32 values by their bits (``_order_key``): +NaN above +inf, -NaN below -inf, -0.0 below
  +0.0; equal bit patterns (NaN ones included) tie like any value;
- ties: among values equal to the k-th largest, the lowest positions are selected.

So a row's selection is a function of that row's valid window alone: it does not change with how
far the row is padded, with the other rows of the batch, or with the device.
"""
import torch
import triton
import triton.language as tl

from .common import check_block_size, check_int, check_same_device, check_tensor, resolve_backend
from .slots import positions_to_slots_reference


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


# ---------------------------------------------------------------- Triton: exact radix select
#
# Keys: fp32 bits mapped to int32 whose bits, read as unsigned, order like ``_order_key`` (NaN by
# its bits). The k-th largest key T of a row is found one 8-bit digit at a time (4 digits). Each row
# is split into C chunks of CHUNK columns, one program per (row, chunk), one launch per pass:
#
#   pass 0  histogram of digit 0 over the chunk
#   pass 1  histogram of digit 1 over the chunk's columns whose digit 0 is the row's threshold digit
#   pass 2  columns above the row's 16-bit threshold prefix go straight to the output; columns equal
#           to it (the candidates) are compacted, stable, into the row's candidate list. The last
#           program of the row to finish (an atomic ticket, no waiting) then finds digits 2 and 3
#           over the candidates alone and writes those above T, then the first (by column) equal to T.
#
# Passes 0 and 1 write each chunk's suffix counts (``suf[r, pass, c, d]``: columns with digit >= d)
# and add their histograms into the row's totals (``hist[r, pass, :]``, atomics on zeroed int32).
# Later programs derive the threshold digits from the totals and their output and list offsets from
# the suffix counts of earlier chunks, so the output is deterministic (no atomic offsets) and every
# column equal to T has a place: the candidate list has room for the whole row, nothing is dropped.
# Rows with length <= k are written densely by pass 0 and skipped by the others.

_BLOCK = 2048  # columns per loop step: 8 warps x 32 threads x 8 fp32 (two 16-byte loads each)
_NUM_WARPS = 8
_PROGRAMS = 512  # programs per pass the row split aims at: ~4 per H200 SM, enough bytes in flight
_CHUNK_STEP = 64  # earlier chunks summed per step


@triton.jit
def _radix_key(x):
    """fp32 -> int32 whose bits, as unsigned, order like the floats (``_order_key`` with the sign flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits ^ -2147483648, bits ^ -1)


@triton.jit
def _pick_digit(h, rem):
    """Threshold digit of one pass from a row's histogram ``h [256]`` of the remaining candidates.

    Returns ``(d, rem')``: the digit of the ``rem``-th largest candidate and how many of the k best
    are still to be found among candidates with digit ``d`` (``rem`` minus those with digit > d).
    """
    bins = tl.arange(0, 256)
    at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # [256] candidates with digit >= bin
    d = tl.minimum(tl.maximum(tl.sum((at_least >= rem).to(tl.int32), 0) - 1, 0), 255)
    return d, rem - tl.sum(tl.where(bins > d, h, 0), 0)


@triton.jit
def _earlier(suf_ptr, c, d, STEP: tl.constexpr):
    """Sum over chunks ``c' < c`` of ``suf[c', d]`` (``suf`` row-major ``[C, 256]``; 0 when d == 256)."""
    acc = tl.zeros([STEP], tl.int32)
    for c0 in range(0, c, STEP):
        cc = c0 + tl.arange(0, STEP)
        acc += tl.load(suf_ptr + cc * 256 + d, mask=cc < tl.where(d < 256, c, 0), other=0)
    return tl.sum(acc, 0)


@triton.jit
def _save_hist(hist_ptr, suf_ptr, h):
    """This chunk's suffix counts to ``suf_ptr [256]``; its histogram added into the row total."""
    bins = tl.arange(0, 256)
    tl.store(suf_ptr + bins, tl.sum(h, 0) - tl.cumsum(h, 0) + h)
    tl.atomic_add(hist_ptr + bins, h, sem="relaxed")


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
def _candidate_keys(cand_row, row_l, j, n, cols):
    """Positions and keys of candidates ``j + cols`` of the row's list (written by other programs of
    this launch: read through L2)."""
    m = j + cols < n
    pos = tl.load(cand_row + j + cols, mask=m, other=0, cache_modifier=".cg")
    return m, pos, _radix_key(tl.load(row_l + pos, mask=m, other=0.0))


@triton.jit
def _finish_row(cand_row, row_l, n, k, rem1, out_row, bt_row, seq_len, MB, P,
                SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """The row's ``n`` candidates share the threshold's 16-bit prefix and ``rem1`` of them are among
    the k best: find digits 2 and 3 of T, then write those above T at ``k - rem1 ...`` and the first
    ones equal to T (list order = column order) at the end of the row."""
    cols = tl.arange(0, BLOCK)
    h = tl.zeros([256], tl.int32)
    for j in range(0, n, BLOCK):
        m, pos, key = _candidate_keys(cand_row, row_l, j, n, cols)
        h += tl.histogram((key >> 8) & 255, 256, mask=m)
    d2, rem2 = _pick_digit(h, rem1)
    h = tl.zeros([256], tl.int32)
    for j in range(0, n, BLOCK):
        m, pos, key = _candidate_keys(cand_row, row_l, j, n, cols)
        h += tl.histogram(key & 255, 256, mask=m & (((key >> 8) & 255) == d2))
    d3, rem3 = _pick_digit(h, rem2)
    low = d2 * 256 + d3  # T's low 16 bits
    n_gt = k - rem1
    n_eq = 0
    for j in range(0, n, BLOCK):
        m, pos, key = _candidate_keys(cand_row, row_l, j, n, cols)
        bottom = key & 65535
        gt = m & (bottom > low)
        eq = m & (bottom == low)
        ranks = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # two counts, 16 bits each
        eq_rank = n_eq + (ranks >> 16) - 1
        _store_positions(out_row, n_gt + (ranks & 65535) - 1, pos, gt, bt_row, seq_len, MB, P, SLOTS)
        _store_positions(out_row, k - rem3 + eq_rank, pos, eq & (eq_rank < rem3), bt_row, seq_len, MB, P, SLOTS)
        counts = tl.max(ranks, 0)
        n_gt += counts & 65535
        n_eq += counts >> 16


@triton.jit
def _topk_pass_kernel(logits_ptr, stride_l, lengths_ptr, starts_ptr, out_ptr, stride_o,
                      hist_ptr, ticket_ptr, suf_ptr, cand_ptr,
                      bt_ptr, stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P,
                      L, k, C, CHUNK,
                      PASS: tl.constexpr, HAS_STARTS: tl.constexpr, SLOTS: tl.constexpr,
                      BLOCK: tl.constexpr, STEP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = 0
    if HAS_STARTS:
        start = tl.maximum(tl.load(starts_ptr + r), 0)  # negative starts count from 0 (as the reference)
    length = tl.maximum(tl.minimum(tl.load(lengths_ptr + r), L - start), 0)
    row_l = logits_ptr + r * stride_l + start  # column `pos` of the row's window at row_l + pos
    out_row = out_ptr + r * stride_o
    bt_row = bt_ptr
    seq_len = 0
    if SLOTS:
        req = tl.load(row_to_req_ptr + r).to(tl.int64)
        req_ok = (req >= 0) & (req < B)  # a row of no request maps nothing: seq_len 0, table never read
        req = tl.where(req_ok, req, 0)
        bt_row = bt_ptr + req * stride_bt
        seq_len = tl.load(seq_lens_ptr + req, mask=req_ok, other=0)
    hist_r = hist_ptr + r * (2 * 256)  # [2, 256] row totals of passes 0 and 1
    suf_r = suf_ptr + r * (2 * C * 256)  # [2, C, 256] suffix counts per pass and chunk
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, length)
    cols = tl.arange(0, BLOCK)
    h = tl.zeros([256], tl.int32)

    if PASS == 0:
        if length <= k:  # dense row: 0, 1, ..., length - 1, then -1
            if c == 0:
                for j in range(0, k, BLOCK):
                    idx = j + cols
                    _store_positions(out_row, idx, tl.where(idx < length, idx, -1), idx < k, bt_row, seq_len,
                                     MB, P, SLOTS)
        else:
            for j in range(lo, hi, BLOCK):
                pos = j + cols
                m = pos < hi
                key = _radix_key(tl.load(row_l + pos, mask=m, other=0.0))
                h += tl.histogram((key >> 24) & 255, 256, mask=m)
            _save_hist(hist_r, suf_r + c * 256, h)
    elif length > k:
        bins = tl.arange(0, 256)
        d0, rem0 = _pick_digit(tl.load(hist_r + bins), k)
        if PASS == 1:
            for j in range(lo, hi, BLOCK):
                pos = j + cols
                m = pos < hi
                key = _radix_key(tl.load(row_l + pos, mask=m, other=0.0))
                h += tl.histogram((key >> 16) & 255, 256, mask=m & (((key >> 24) & 255) == d0))
            _save_hist(hist_r + 256, suf_r + (C + c) * 256, h)
        else:
            d1, rem1 = _pick_digit(tl.load(hist_r + 256 + bins), rem0)
            prefix = d0 * 256 + d1
            suf1 = suf_r + C * 256
            n_sel = _earlier(suf_r, c, d0 + 1, STEP) + _earlier(suf1, c, d1 + 1, STEP)  # columns above, earlier chunks
            n_cand = _earlier(suf1, c, d1, STEP) - _earlier(suf1, c, d1 + 1, STEP)
            cand_row = cand_ptr + r * L
            for j in range(lo, hi, BLOCK):
                pos = j + cols
                m = pos < hi
                key = _radix_key(tl.load(row_l + pos, mask=m, other=0.0))
                top = (key >> 16) & 65535
                sel = m & (top > prefix)
                cand = m & (top == prefix)
                ranks = tl.cumsum(sel.to(tl.int32) + (cand.to(tl.int32) << 16), 0)  # two counts, 16 bits each
                _store_positions(out_row, n_sel + (ranks & 65535) - 1, pos, sel, bt_row, seq_len, MB, P, SLOTS)
                tl.store(cand_row + n_cand + (ranks >> 16) - 1, pos, mask=cand)
                counts = tl.max(ranks, 0)
                n_sel += counts & 65535
                n_cand += counts >> 16
            tl.debug_barrier()  # every thread's list entries are written before the ticket releases them
            if tl.atomic_add(ticket_ptr + r, 1, sem="acq_rel") == C - 1:  # the row's last program
                n = tl.load(hist_r + 256 + d1)  # the row's candidates
                _finish_row(cand_row, row_l, n, k, rem1, out_row, bt_row, seq_len, MB, P, SLOTS, BLOCK)


def _topk_triton(logits, lengths, k, starts, slots=None, *, block=_BLOCK, programs=_PROGRAMS, num_warps=_NUM_WARPS,
                 out=None):
    """Launch the passes (one when ``L <= k``: every row is dense). ``slots``: ``(block_table,
    row_to_req, seq_lens, block_size)`` to write slots; ``block``/``programs``/``num_warps``/``out``
    for tests and tuning."""
    r, width = logits.shape
    assert block < 65536  # per-step counts are packed 16 bits apiece
    if out is None:
        out = torch.empty((r, k), dtype=torch.int32, device=logits.device)
    if r == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    lengths = lengths.contiguous()
    starts_t = lengths if starts is None else starts.contiguous()
    chunks = max(1, min(triton.cdiv(width, block), triton.cdiv(programs, r)))
    chunk = triton.cdiv(triton.cdiv(max(width, 1), chunks), block) * block
    chunks = max(1, triton.cdiv(width, chunk))
    passes = 1 if width <= k else 3
    i32 = dict(dtype=torch.int32, device=logits.device)
    if passes == 1:
        hist = tickets = suf = cand = out  # never read: every row is dense
    else:
        zeroed = torch.zeros(r * (2 * 256 + 1), **i32)  # one memset: row totals (added atomically), tickets
        hist, tickets = zeroed[:r * 512], zeroed[r * 512:]
        suf = torch.empty((r, 2, chunks, 256), **i32)  # every entry written by its chunk's program
        cand = torch.empty((r, width), **i32)  # candidate lists, room for whole rows
    if slots is None:
        bt, row_to_req, seq_lens, block_size = out, out, out, 1
    else:
        bt, row_to_req, seq_lens, block_size = slots
        bt, row_to_req, seq_lens = bt.contiguous(), row_to_req.contiguous(), seq_lens.contiguous()
    grid = (r, chunks if passes > 1 else 1)
    for p in range(passes):
        _topk_pass_kernel[grid](
            logits, logits.stride(0), lengths, starts_t, out, out.stride(0),
            hist, tickets, suf, cand,
            bt, bt.stride(0), row_to_req, seq_lens, bt.shape[0], bt.shape[1], block_size,
            width, k, chunks, chunk,
            PASS=p, HAS_STARTS=starts is not None, SLOTS=slots is not None,
            BLOCK=block, STEP=_CHUNK_STEP, num_warps=num_warps)
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
