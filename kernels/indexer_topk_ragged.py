"""indexer_topk_ragged: the prefill indexer's ragged logits streamed tile by tile into an exact top-k per
row, as positions or cache slots; no ``[rows, keys]`` logits are written.

The result equals ``topk_indices`` / ``topk_slots`` of ``indexer_logits_ragged``'s logits bit for bit:
the same positions in the same order (the Triton top-k's order, below), ties and NaN included, and a
row's result is a function of that row alone. Two launches, no memset, no atomics:

  stream  (program per BLOCK_T tokens x key split) scores key tiles with the FP8 pieces of
          ``indexer_logits_ragged`` (``query_tile``, ``key_tile``, ``tile_logits``: the same logits, bit
          for bit) and keeps, per row, a region of ``CAP`` candidates ``key << 32 | column`` (``key_of``
          keys, in column order) that holds the row's top-k of the keys seen so far: a logit enters
          when its key reaches the row's bound ``theta``; when an append would overflow the region, the
          region keeps its k best (the k-th value found 8 bits at a time, its ties to the first
          entries, in place, in order) and ``theta`` becomes the k-th key + 1 (a later equal key has a
          higher column: it loses the tie). It also stores the top-k's sample (``SAMPLE`` keys at the
          positions ``kernels/topk`` samples) as the tile that holds them streams by;
  finish  (program per row) joins the split regions into one list in column order (a superset of
          the row's top-k, every entry a real logit of the row) and makes the Triton top-k's output
          from it: the guess ``(lo, shift)`` from the sample, the bins, the k-th value's bin b, the
          entries of the bins above b in column order, then bin b's best digit by digit (its entries
          above the k-th value in column order, then its first ties).

The region's bound makes the workspace ``T x splits x CAP`` entries (``CAP = 2k``; splits only when
the tokens alone do not fill the GPU, so ``T x splits`` stays near ``waves x SMs x BLOCK_T``) plus
``T x SAMPLE`` sample keys: independent of the context length. Why exact: an entry leaves a region or
is refused only when k entries of the same row rank above it (by ``order_key``, ties to the lowest
column), so the regions hold the row's top-k; the order is the top-k's, recomputed from that superset:
it depends on the row's k-th value, its sample and the column order of its selected entries only.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import check_block_size, check_int, check_same_device, check_tensor, resolve_backend, sm_count
from .indexer_logits_ragged import (
    first_scales,
    indexer_logits_ragged_reference,
    key_tile,
    query_tile,
    scored_tiles,
    tile_logits,
    token_ranges,
)
from .slots import positions_to_slots_reference
from .topk.guess import INT_MIN, SEG, Z, guess_from_sample, key_of, pick_digit
from .topk.launch import BLOCK, SAMPLE
from .topk.reference import topk_indices_reference
from .topk.regions import bin_of, row_request
from .topk.select import LBLOCK, SBLOCK, kth_value, refine, store_positions

MAX_SPLITS = 16  # key splits per token tile at most (the workspace is T x splits x CAP entries)
_NO_RUN = tl.constexpr(2**31 - 1)  # a sample run position past every row
_RUNS = tl.constexpr(SAMPLE // SEG)  # the sample's runs of SEG columns


def indexer_topk_ragged_reference(q8, weights, k8, k_scale, starts, ends, k, slots=None):
    """The chunked path in torch: ``indexer_logits_ragged_reference`` then ``topk_indices_reference``
    (and ``positions_to_slots_reference``), rows in chunks that bound the logits to 2**26 entries."""
    t, s = q8.shape[0], k8.shape[0]
    s0 = starts.clamp_min(0)
    n = (ends.clamp_max(s) - s0).clamp_min(0).to(torch.int32)
    step = max(1, (1 << 26) // max(1, s))
    out = [topk_indices_reference(indexer_logits_ragged_reference(q8[r0:r0 + step], weights[r0:r0 + step], k8,
                                                                  k_scale, starts[r0:r0 + step], ends[r0:r0 + step]),
                                  n[r0:r0 + step], k, s0[r0:r0 + step].to(torch.int32))
           for r0 in range(0, t, step)]
    pos = torch.cat(out) if out else torch.empty((0, k), dtype=torch.int32, device=q8.device)
    if slots is None:
        return pos
    block_table, row_to_req, seq_lens, block_size = slots
    return positions_to_slots_reference(pos, block_table, row_to_req, seq_lens, block_size)


@triton.jit
def _next_run(x, n):
    """Position (row-relative, int32 ``[BLOCK_T]``) of the first sample run starting at ``x`` or later:
    run ``j`` starts at ``j * n // RUNS``, so ``j = ceil(x * RUNS / n)``; ``_NO_RUN`` if none."""
    nn = tl.maximum(n, 1).to(tl.int64)
    j = tl.where(x > 0, (x.to(tl.int64) * _RUNS + nn - 1) // nn, 0)
    return tl.where(j < _RUNS, j * nn // _RUNS, _NO_RUN).to(tl.int32)


@triton.jit
def _store_sample(sample_ptr, t, key, rel, n, inside, sampled, SAMPLE: tl.constexpr, SEG: tl.constexpr):
    """Store the tile's keys ``[BLOCK_S, BLOCK_T]`` that are sample columns of their row (``rel``:
    row-relative columns): column ``rel`` lies in run ``j``, the last starting at or before it,
    at offset ``rel - j * n // RUNS``; runs do not overlap when ``n >= SAMPLE`` (``sampled`` rows)."""
    nn = tl.maximum(n, 1).to(tl.int64)[None, :]
    j = ((rel.to(tl.int64) + 1) * _RUNS - 1) // nn
    off = rel - (j * nn // _RUNS).to(tl.int32)
    m = inside & sampled[None, :] & (off < SEG)
    tl.store(sample_ptr + t[None, :] * SAMPLE + j * SEG + off, key, mask=m)


@triton.jit
def _keep_best(region, n_c, k, LBLOCK: tl.constexpr):
    """Keep the k best of the ``n_c > k`` entries of ``region`` (their ties: the first ones) in place,
    in order; returns the k-th best key."""
    tl.debug_barrier()  # the appends are written before they are read back
    t, rem = kth_value(region, n_c, k, INT_MIN, tl.full([], 32, tl.int32), tl.zeros([], tl.int64), LBLOCK)
    idx = tl.arange(0, LBLOCK)
    n_out = 0
    n_eq = 0
    for j in range(0, n_c, LBLOCK):
        m = j + idx < n_c
        e = tl.load(region + j + idx, mask=m, other=0, cache_modifier=".cg")
        v = (e >> 32) - INT_MIN
        eq = m & (v == t)
        keep = (m & (v > t)) | (eq & (n_eq + tl.cumsum(eq.to(tl.int32), 0) <= rem))
        dest = n_out + tl.cumsum(keep.to(tl.int32), 0) - 1  # <= j + idx: nothing unread is overwritten
        tl.debug_barrier()  # the step is read before it is overwritten
        tl.store(region + dest, e, mask=keep)
        n_out += tl.sum(keep.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)
    return (t + INT_MIN).to(tl.int32)


@triton.jit(do_not_specialize=["num_tokens", "num_keys", "tiles_per_prog", "splits"],
            do_not_specialize_on_alignment=["w_ptr", "starts_ptr", "ends_ptr"])
def _stream_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, starts_ptr, ends_ptr, cand_ptr, cnt_ptr, sample_ptr, num_tokens,
                   num_keys, tiles_per_prog, splits, k, CAP, HI: tl.constexpr, HI_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, TMA: tl.constexpr,
                   STAGES: tl.constexpr, SAMPLE: tl.constexpr, SEG: tl.constexpr, LBLOCK: tl.constexpr):
    # program (t tile, split): BLOCK_T tokens against the key tiles [split * tiles_per_prog, ...) that
    # meet a row of more than k keys; each row's candidates into its region of cand [T, splits, CAP],
    # their count into cnt [T, splits]; rows of at most k keys are not scored (their top-k is dense).
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    split = tl.program_id(1)
    q_t, w = query_tile(q_ptr, w_ptr, t0, num_tokens, HI, HI_PAD, BLOCK_T, D)
    t, t_ok, start, end = token_ranges(starts_ptr, ends_ptr, t0, num_tokens, num_keys, BLOCK_T)
    s0 = tl.maximum(start, 0)
    n = tl.maximum(tl.minimum(end, num_keys) - s0, 0)  # the row's window [s0, s0 + n)
    big = n > k
    lo = tl.min(tl.where(big, s0, num_keys), axis=0)
    hi = tl.max(tl.where(big, s0 + n, 0), axis=0)
    s_begin = split * tiles_per_prog * BLOCK_S
    s_end = tl.minimum(s_begin + tiles_per_prog * BLOCK_S, num_keys)
    c_begin, c_tiles = scored_tiles(s_begin, s_end, lo, hi, BLOCK_S)
    rows = tl.arange(0, BLOCK_T)
    theta = tl.full([BLOCK_T], INT_MIN, tl.int32)  # a key enters its row's region when >= theta (and live)
    live = big.to(tl.int32)  # 0: no key can enter (not scored, or a k-th best key of INT_MAX)
    cnt = tl.zeros([BLOCK_T], tl.int32)
    sampled = big & (n >= SAMPLE)  # rows whose sample is stored here (a shorter row's region is all of it)
    p_next = tl.where(sampled, _next_run(c_begin - s0 - SEG + 1, n), _NO_RUN)  # the next run to store
    k_scale_next = first_scales(ks_ptr, c_begin, num_keys, BLOCK_S, TMA)
    for tile in tl.range(0, c_tiles, num_stages=STAGES):
        k0 = c_begin + tile * BLOCK_S
        pos = k0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        keys, k_scale, k_scale_next = key_tile(k_ptr, ks_ptr, k0, num_keys, k_scale_next, D, BLOCK_S, TMA)
        key = key_of(tile_logits(keys, q_t, w, k_scale, BLOCK_S, BLOCK_T, HI_PAD))  # [BLOCK_S, BLOCK_T] int32
        rel = pos[:, None] - s0[None, :]  # [BLOCK_S, BLOCK_T] int32
        inside = (rel >= 0) & (rel < n[None, :])
        if tl.max((p_next < k0 + BLOCK_S - s0).to(tl.int32), axis=0) > 0:  # a sample run meets the tile
            _store_sample(sample_ptr, t, key, rel, n, inside, sampled, SAMPLE, SEG)
            p_next = tl.where(sampled, _next_run(k0 + BLOCK_S - s0 - SEG + 1, n), _NO_RUN)
        sel = inside & (live[None, :] != 0) & (key >= theta[None, :])
        n_sel = tl.sum(sel.to(tl.int32), axis=0)  # [BLOCK_T]
        if tl.max(cnt + n_sel - CAP, axis=0) > 0:  # a region would overflow: it keeps its k best
            for j in tl.static_range(BLOCK_T):
                cnt_j = tl.sum(tl.where(rows == j, cnt, 0), axis=0)
                if cnt_j + tl.sum(tl.where(rows == j, n_sel, 0), axis=0) > CAP:
                    kth = _keep_best(cand_ptr + ((t0 + j) * splits + split) * CAP, cnt_j, k, LBLOCK)
                    theta = tl.where(rows == j, kth + (kth < 2**31 - 1).to(tl.int32), theta)
                    live = tl.where(rows == j, (kth < 2**31 - 1).to(tl.int32), live)
                    cnt = tl.where(rows == j, k, cnt)
            sel = inside & (live[None, :] != 0) & (key >= theta[None, :])
            n_sel = tl.sum(sel.to(tl.int32), axis=0)
        if tl.sum(n_sel, axis=0) > 0:
            rank = tl.cumsum(sel.to(tl.int32), axis=0)
            dest = (t * splits + split) * CAP + cnt + rank - 1  # into the row's region of cand [T, splits, CAP]
            tl.store(cand_ptr + dest, (key.to(tl.int64) << 32) | rel.to(tl.int64), mask=sel)
            cnt += n_sel
    tl.store(cnt_ptr + t * splits + split, cnt, mask=t_ok)


@triton.jit
def _join_regions(lst, cnt_row, splits, CAP, LBLOCK: tl.constexpr):
    """Move the ``splits`` regions' entries (``cnt_row[c]`` each, at ``lst + c * CAP``) into one list at
    ``lst``, regions in order (so in column order); its length. An entry only moves down."""
    idx = tl.arange(0, LBLOCK)
    n_list = tl.load(cnt_row)
    for c in range(1, splits):
        n_c = tl.load(cnt_row + c)
        for j in range(0, n_c, LBLOCK):
            m = j + idx < n_c
            e = tl.load(lst + c * CAP + j + idx, mask=m, other=0, cache_modifier=".cg")
            tl.debug_barrier()
            tl.store(lst + n_list + j + idx, e, mask=m)
        n_list += n_c
    tl.debug_barrier()
    return n_list


@triton.jit
def _bin_hist(lst, n_list, lo, shift, LBLOCK: tl.constexpr):
    """The bin histogram of the list's entries whose key reaches ``lo`` (the top-k's candidates)."""
    idx = tl.arange(0, LBLOCK)
    h = tl.zeros([256], tl.int32)
    for j in range(0, n_list, LBLOCK):
        m = j + idx < n_list
        key = (tl.load(lst + j + idx, mask=m, other=0, cache_modifier=".cg") >> 32).to(tl.int32)
        h += tl.histogram(bin_of(tl.maximum(key, lo), lo, shift), 256, mask=m & (key >= lo))
    return h


@triton.jit
def _place_bins(lst, n_list, lo, shift, b, out_row, bt_row, seq_len, MB, P, SLOTS: tl.constexpr,
                LBLOCK: tl.constexpr):
    """The top-k's place step on one list: its entries of the bins above ``b`` to the output in column
    order, those of bin ``b`` to the front of the list in column order; their count."""
    idx = tl.arange(0, LBLOCK)
    n_gt = 0
    n_eq = 0
    for j in range(0, n_list, LBLOCK):
        m = j + idx < n_list
        e = tl.load(lst + j + idx, mask=m, other=0, cache_modifier=".cg")
        key = (e >> 32).to(tl.int32)
        bn = bin_of(tl.maximum(key, lo), lo, shift)
        gt = m & (key >= lo) & (bn > b)
        eq = m & (key >= lo) & (bn == b)
        rank = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # two counts, 16 bits each
        tl.debug_barrier()  # the step is read before the front is overwritten
        store_positions(out_row, n_gt + (rank & 65535) - 1, e.to(tl.int32), gt, bt_row, seq_len, MB, P, SLOTS)
        tl.store(lst + n_eq + (rank >> 16) - 1, e, mask=eq)
        total = tl.max(rank, 0)
        n_gt += total & 65535
        n_eq += total >> 16
    return n_eq


@triton.jit(do_not_specialize=["num_keys", "splits", "stride_bt", "B", "MB"],
            do_not_specialize_on_alignment=["starts_ptr", "ends_ptr", "bt_ptr", "row_to_req_ptr", "seq_lens_ptr"])
def _stream_finish_kernel(starts_ptr, ends_ptr, num_keys, out_ptr, cand_ptr, cnt_ptr, sample_ptr, bt_ptr,
                          stride_bt, row_to_req_ptr, seq_lens_ptr, B, MB, P, splits, k, CAP, SLOTS: tl.constexpr,
                          SAMPLE: tl.constexpr, SEG: tl.constexpr, Z: tl.constexpr, BLOCK: tl.constexpr,
                          SBLOCK: tl.constexpr, LBLOCK: tl.constexpr):
    # program (row): a row of at most k keys is 0 .. n - 1 then -1; a longer one is what the top-k
    # writes for its logits, made from the row's regions.
    r = tl.program_id(0).to(tl.int64)
    s0 = tl.maximum(tl.load(starts_ptr + r), 0)
    n = tl.maximum(tl.minimum(tl.load(ends_ptr + r), num_keys) - s0, 0)
    bt_row, seq_len = row_request(r, row_to_req_ptr, bt_ptr, stride_bt, seq_lens_ptr, B, SLOTS)
    out_row = out_ptr + r * k
    if n <= k:
        cols = tl.arange(0, BLOCK)
        for j in range(0, k, BLOCK):
            idx = j + cols
            store_positions(out_row, idx, tl.where(idx < n, idx, -1), idx < k, bt_row, seq_len, MB, P, SLOTS)
    else:
        lst = cand_ptr + r * splits * CAP
        n_list = _join_regions(lst, cnt_ptr + r * splits, splits, CAP, LBLOCK)
        i = tl.arange(0, SAMPLE)
        if n >= SAMPLE:  # stored by the stream
            keys = tl.load(sample_ptr + r * SAMPLE + i)
        else:  # the list is the whole row
            pos = tl.minimum((i // SEG) * n // (SAMPLE // SEG) + i % SEG, n - 1)
            keys = (tl.load(lst + pos, cache_modifier=".cg") >> 32).to(tl.int32)
        lo, shift = guess_from_sample(keys ^ INT_MIN, n, k, SAMPLE, Z)
        h = _bin_hist(lst, n_list, lo, shift, LBLOCK)
        ok = tl.sum(h, 0) >= k  # at least k keys reach lo (the list holds the row's top-k)
        b, rem = pick_digit(h, k)
        n_b = n_list
        if ok:
            n_b = _place_bins(lst, n_list, lo, shift, b, out_row, bt_row, seq_len, MB, P, SLOTS, LBLOCK)
        refine(lst, n_b, ok, b, rem, k, lo, shift, out_row, bt_row, seq_len, MB, P, SLOTS, SBLOCK, LBLOCK)


def default_cap(k: int, block_s: int = 64) -> int:
    """Candidates a region holds: ``2k`` (at least ``k + BLOCK_S`` and ``SAMPLE``)."""
    return max(2 * k, k + block_s, SAMPLE)


def _indexer_topk_ragged_triton(q8, weights, k8, k_scale, starts, ends, k, slots=None, *, block_s=64, block_t=None,
                                num_warps=8, stages=3, tma=False, waves=2, cap=None, splits=None, maxnreg=None,
                                out=None, fill=None, scratch=None):
    """The two launches. Tuning knobs (private; tests and ``dsa bench indexer``): the stream's tile
    (``block_s``, ``block_t``, ``num_warps``, ``stages``, ``tma``: ``indexer_logits_ragged``'s, whose
    defaults these are), ``waves`` (programs per SM to aim for), ``cap`` (region entries, at least
    ``k + block_s`` and ``SAMPLE``), ``splits`` (key splits; default: enough programs for ``waves``,
    at most ``MAX_SPLITS``), ``maxnreg`` (a register cap per thread for the stream: at sm_90 and 8
    warps it compiles to 254 registers, one program an SM; 128 allows two). Tests: ``out`` (written
    in place), ``fill`` (an int the workspace is filled with first: nothing may depend on it),
    ``scratch`` (a dict that receives the region counts ``[T, splits]``, the splits and the region
    size)."""
    t, hi, di = q8.shape
    s = k8.shape[0]
    if out is None:
        out = torch.empty((t, k), dtype=torch.int32, device=q8.device)
    if t == 0:
        return out
    q8, weights, k8, k_scale = q8.contiguous(), weights.contiguous(), k8.contiguous(), k_scale.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    hi_pad = max(16, triton.next_power_of_2(hi))
    block_t = max(1, 256 // hi_pad) if block_t is None else block_t
    cap = default_cap(k, block_s) if cap is None else cap
    if cap < max(k + block_s, SAMPLE):
        raise ValueError(f"cap: expected at least k + block_s and {SAMPLE}, got {cap}")
    t_tiles, s_tiles = triton.cdiv(t, block_t), triton.cdiv(s, block_s)
    if splits is None:
        splits = max(1, min(s_tiles, MAX_SPLITS, triton.cdiv(waves * sm_count(q8.device), t_tiles)))
    tiles_per_prog = triton.cdiv(s_tiles, max(1, splits))
    splits = triton.cdiv(s_tiles, tiles_per_prog) if s_tiles else 1
    cand, cnt = out.new_empty((1,), dtype=torch.int64), out  # never read unless s > k (the types of their variant)
    sample = out
    if s > k:  # else every row is dense: nothing is scored
        cand = torch.empty((t, splits * cap), dtype=torch.int64, device=q8.device)
        cnt = torch.empty((t, splits), dtype=torch.int32, device=q8.device)
        sample = torch.empty((t, SAMPLE), dtype=torch.int32, device=q8.device)
        if fill is not None:
            for x in (cand, cnt, sample):
                x.fill_(fill)
        keys, scales = k8, k_scale
        if tma and di in (64, 128) and k8.data_ptr() % 16 == 0 and k_scale.data_ptr() % 16 == 0:
            keys = TensorDescriptor(k8, [s, di], [di, 1], [block_s, di])
            scales = TensorDescriptor(k_scale, [s], [1], [block_s])
        # one variant per (HI, DI, k, tiles, tma): T, S, the splits and their tiles change per step (runtime
        # values); weights, starts and ends (plan views at any offset) are not specialized on their alignment
        _stream_kernel[(t_tiles, splits)](
            q8, weights, keys, scales, starts, ends, cand, cnt, sample, t, s, tiles_per_prog, splits, k, cap,
            HI=hi, HI_PAD=hi_pad, BLOCK_T=block_t, D=di, BLOCK_S=block_s, TMA=keys is not k8, STAGES=stages,
            SAMPLE=SAMPLE, SEG=SEG, LBLOCK=LBLOCK, num_warps=num_warps, num_stages=stages,
            **({} if maxnreg is None else dict(maxnreg=maxnreg)))
        if scratch is not None:
            scratch.update(counts=cnt, splits=splits, cap=cap)
    if slots is None:
        bt, row_to_req, seq_lens, block_size = out, out, out, 1
    else:
        bt, row_to_req, seq_lens, block_size = slots
        bt, row_to_req, seq_lens = bt.contiguous(), row_to_req.contiguous(), seq_lens.contiguous()
    _stream_finish_kernel[(t,)](
        starts, ends, s, out, cand, cnt, sample, bt, bt.stride(0), row_to_req, seq_lens, bt.shape[0], bt.shape[1],
        block_size, splits, k, cap, SLOTS=slots is not None, SAMPLE=SAMPLE, SEG=SEG, Z=Z, BLOCK=BLOCK,
        SBLOCK=SBLOCK, LBLOCK=LBLOCK, num_warps=4)
    return out


def indexer_topk_ragged(q8: torch.Tensor, weights: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                        starts: torch.Tensor, ends: torch.Tensor, k: int, *, block_table: torch.Tensor | None = None,
                        row_to_req: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                        block_size: int | None = None, backend: str = "auto") -> torch.Tensor:
    """The top-k of prefill rows' indexer logits against ``S`` contiguous keys, streamed: the same
    result as :func:`~dsa.kernels.indexer_logits_ragged` then :func:`~dsa.kernels.topk_indices` (or
    :func:`~dsa.kernels.topk_slots`), without the ``[T, S]`` logits.

    Args:
        q8: ``[T, HI, DI]`` float8_e4m3fn queries (``1 <= HI <= 128``, ``DI`` in 32, 64, 128, 256).
        weights: ``[T, HI]`` float32 head weights (query scales folded in).
        k8: ``[S, DI]`` float8_e4m3fn keys (from ``gather_indexer_keys``).
        k_scale: ``[S]`` float32 key scales.
        starts, ends: ``[T]`` int32: row ``t`` ranks the logits of keys ``[max(start, 0), min(end, S))``,
            ``sum_h weights[t, h] * relu(q8[t, h] . k8[s]) * k_scale[s]``.
        k: columns to keep (``index_topk``), an int >= 1.
        block_table, row_to_req, seq_lens, block_size: all four or none; given, positions are written as
            cache slots: ``[B, MB]`` int32, ``[T]`` int32, ``[B]`` int32 and ``P``, as :func:`topk_slots`.

    Returns:
        ``[T, k]`` int32: ``topk_indices(logits, n, k, s0)`` with ``s0 = max(start, 0)`` and ``n = max(min(end, S)
        - s0, 0)``, bit for bit (positions relative to ``s0``, ``-1`` padded; a row of ``n <= k`` keys is
        ``0 .. n - 1``; ties at the k-th value to the lowest positions, NaN by its bits); with the slot
        arguments, ``topk_slots`` of the same (``-1`` for padding and whatever cannot be mapped).

    Workspace (the caller bounds ``T``): ``T x splits x 2k`` int64 candidates and ``T x 512`` int32
    sample keys, independent of ``S``; nothing of size ``T x S`` is written. The torch backend is the
    chunked path of the references.
    """
    check_tensor("q8", q8, dtype=torch.float8_e4m3fn, shape=3)
    t, hi, di = q8.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, hi))
    check_tensor("k8", k8, dtype=torch.float8_e4m3fn, shape=(None, di))
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    check_tensor("starts", starts, dtype=torch.int32, shape=(t,))
    check_tensor("ends", ends, dtype=torch.int32, shape=(t,))
    k = check_int("k", k, minimum=1)
    device = check_same_device(q8=q8, weights=weights, k8=k8, k_scale=k_scale, starts=starts, ends=ends)
    table = (block_table, row_to_req, seq_lens, block_size)
    slots = None
    if any(x is not None for x in table):
        if any(x is None for x in table):
            raise ValueError("block_table, row_to_req, seq_lens, block_size: pass all four or none")
        block_size = check_block_size(block_size)
        check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
        check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(t,))
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
        check_same_device(q8=q8, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
        slots = (block_table, row_to_req, seq_lens, block_size)
    impl = resolve_backend(backend, device, "indexer_topk_ragged", block_size=block_size)
    if impl == "torch":
        return indexer_topk_ragged_reference(q8, weights, k8, k_scale, starts, ends, k, slots)
    if not 1 <= hi <= 128 or di not in (32, 64, 128, 256):
        raise ValueError(f"q8: the Triton kernel takes 1 <= HI <= 128 and DI in 32, 64, 128, 256; got shape "
                         f"{list(q8.shape)}")
    return _indexer_topk_ragged_triton(q8, weights, k8, k_scale, starts, ends, k, slots)
