"""indexer_logits_ragged: prefill-row indexer logits against contiguous keys, per-row [start, end)."""

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import deepgemm, indexer_logits_ragged_hopper as hopper
from .common import check_same_device, check_tensor, compute_dtype, resolve_backend, sm_count


def indexer_logits_ragged_reference(q8, weights, k8, k_scale, starts, ends):
    t, hi, di = q8.shape
    s = k8.shape[0]
    dt = compute_dtype(q8, weights, k8 if k8.is_floating_point() else None)
    k = k8.to(dt)  # [S, DI]
    cols = torch.arange(s, device=q8.device)
    logits = torch.empty((t, s), dtype=torch.float32, device=q8.device)
    chunk = max(1, (1 << 24) // max(1, hi * s))  # bounds the [chunk, HI, S] temporary
    for t0 in range(0, t, chunk):
        q = q8[t0:t0 + chunk].to(dt)  # [C, HI, DI]
        score = torch.einsum("ch,chs->cs", weights[t0:t0 + chunk].to(dt), torch.relu(torch.einsum("chd,sd->chs", q, k)))
        if k_scale is not None:
            score = score * k_scale.to(dt)
        inside = (cols >= starts[t0:t0 + chunk, None]) & (cols < ends[t0:t0 + chunk, None])
        logits[t0:t0 + chunk] = torch.where(inside, score, float("-inf")).float()
    return logits


@triton.jit(do_not_specialize=["num_tokens", "num_keys", "tiles_per_prog"],
            do_not_specialize_on_alignment=["w_ptr", "starts_ptr", "ends_ptr"])
def _indexer_logits_ragged_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, starts_ptr, ends_ptr, out_ptr, num_tokens,
                                  num_keys, tiles_per_prog, HI: tl.constexpr, HI_PAD: tl.constexpr,
                                  BLOCK_T: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, TMA: tl.constexpr,
                                  STAGES: tl.constexpr):
    # program (t tile, split): BLOCK_T query tokens (all their heads: the dot's N dim) against key
    # tiles [split * tiles_per_prog, ...) of BLOCK_S keys (its M dim); tiles outside every row's
    # [start, end) are written as -inf without being scored. TMA: k_ptr and ks_ptr are descriptors
    # of k8 [S, D] and k_scale [S] (zeros past S, as the masked loads).
    M: tl.constexpr = BLOCK_T * HI_PAD
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    m = tl.arange(0, M)
    tq, h = t0 + m // HI_PAD, m % HI_PAD
    q_ok = (tq < num_tokens) & (h < HI)
    q_row = tq * HI + h  # [M] int64
    d = tl.arange(0, D)
    q = tl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=q_ok[:, None], other=0.0)  # [M, D] e4m3
    w = tl.load(w_ptr + q_row, mask=q_ok, other=0.0)  # [M] fp32
    q_t = tl.trans(q)  # [D, M], K-contiguous
    t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_ok = t < num_tokens
    start = tl.load(starts_ptr + t, mask=t_ok, other=num_keys)
    end = tl.load(ends_ptr + t, mask=t_ok, other=0)
    lo = tl.maximum(tl.min(start, axis=0), 0)
    hi = tl.minimum(tl.max(end, axis=0), num_keys)
    out_row = t * num_keys  # [BLOCK_T] int64
    s_begin = tl.program_id(1) * tiles_per_prog * BLOCK_S
    s_end = tl.minimum(s_begin + tiles_per_prog * BLOCK_S, num_keys)
    c_begin = tl.minimum(tl.maximum(s_begin, lo // BLOCK_S * BLOCK_S), s_end)  # tile-aligned
    c_tiles = tl.cdiv(tl.maximum(tl.minimum(s_end, hi), c_begin) - c_begin, BLOCK_S)
    minus_inf = tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32)
    for tile in range(0, (c_begin - s_begin) // BLOCK_S):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(out_ptr + out_row[None, :] + pos[:, None], minus_inf, mask=t_ok[None, :] & (pos < s_end)[:, None])
    # key scales are prefetched one tile ahead (Triton pipelines only the loads that feed the dot)
    pos_next = c_begin + tl.arange(0, BLOCK_S)
    if not TMA:
        k_scale_next = tl.load(ks_ptr + pos_next, mask=pos_next < num_keys, other=0.0)
    for tile in tl.range(0, c_tiles, num_stages=STAGES):
        pos = c_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        if TMA:
            k = k_ptr.load([c_begin + tile * BLOCK_S, 0])  # [BLOCK_S, D] e4m3
            k_scale = ks_ptr.load([c_begin + tile * BLOCK_S])  # [BLOCK_S] fp32
        else:
            k = tl.load(k_ptr + pos[:, None].to(tl.int64) * D + d[None, :], mask=(pos < num_keys)[:, None], other=0.0)
            k_scale = k_scale_next  # [BLOCK_S] fp32
            pos_next += BLOCK_S
            k_scale_next = tl.load(ks_ptr + pos_next, mask=pos_next < num_keys, other=0.0)
        score = tl.dot(k, q_t)  # [BLOCK_S, M] fp32
        score = tl.maximum(score, 0.0) * w[None, :]
        logit = tl.sum(tl.reshape(score, [BLOCK_S, BLOCK_T, HI_PAD]), axis=2) * k_scale[:, None]  # [BLOCK_S, BLOCK_T]
        inside = (pos[:, None] >= start[None, :]) & (pos[:, None] < end[None, :])
        logit = tl.where(inside, logit, float("-inf"))
        tl.store(out_ptr + out_row[None, :] + pos[:, None], logit, mask=t_ok[None, :] & (pos < s_end)[:, None])
    for tile in range((c_begin - s_begin) // BLOCK_S + c_tiles, tiles_per_prog):
        pos = s_begin + tile * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(out_ptr + out_row[None, :] + pos[:, None], minus_inf, mask=t_ok[None, :] & (pos < s_end)[:, None])


def ragged_grid(t: int, s: int, block_t: int, block_s: int, slots: int) -> tuple[tuple[int, int], int]:
    """``((row tiles, key splits), key tiles a program)`` for ``t`` rows against ``s`` keys: the key axis
    split so the grid stays within ``slots`` programs (one wave) whenever the row tiles alone do. A few
    programs past a wave cost a second wave of the whole per-program time: 64 rows x 1M keys split 17 ways
    (272 programs for 264 slots) took 1.76 ms on the H200
    (``benchmarks/results/prefill-indexer-split-h200-2026-12-02-at-ed8ad97.json``)."""
    t_tiles, s_tiles = triton.cdiv(t, block_t), triton.cdiv(s, block_s)
    splits = max(1, min(s_tiles, slots // t_tiles))
    tiles_per_prog = triton.cdiv(s_tiles, splits)
    return (t_tiles, triton.cdiv(s_tiles, tiles_per_prog)), tiles_per_prog


SETUP_TILES = 6  # a program's fixed cost (its queries, the ring filling, the last epilogue) in key tiles' time


@functools.lru_cache(maxsize=4096)
def wave_grid(t: int, s: int, block_t: int, block_s: int, slots: int) -> tuple[tuple[int, int], int]:
    """``((row tiles, key splits), key tiles a program)`` for a kernel of one program a slot: the key split
    that minimizes ``waves * (key tiles a program + SETUP_TILES)`` (by 3% at least over fewer splits), so the
    last wave is not left mostly idle. ``ragged_grid``'s one-wave rule leaves 100 row tiles (160K keys a call)
    unsplit, 100 busy SMs of 132; split five ways they fill four waves to 95% (1,422 -> 1,026 us on the H200,
    ``benchmarks/results/prefill-indexer-split-h200-2026-12-03-at-b1f80b3.json``). Splits past eight waves'
    worth are not tried."""
    t_tiles, s_tiles = triton.cdiv(t, block_t), triton.cdiv(s, block_s)
    best = None
    for want in range(1, min(s_tiles, triton.cdiv(8 * slots, t_tiles)) + 1):
        per = triton.cdiv(s_tiles, want)
        splits = triton.cdiv(s_tiles, per)
        cost = triton.cdiv(t_tiles * splits, slots) * (per + SETUP_TILES)
        if best is None or cost < 0.97 * best[0]:  # more splits only for a clear gain
            best = (cost, splits, per)
    return (t_tiles, best[1]), best[2]


def _indexer_logits_ragged_triton(q8, weights, k8, k_scale, starts, ends, *, block_s=64, block_t=None, num_warps=4,
                                  stages=None, tma=False, waves=2, hopper_kernel=False):
    """The launch. Tuning knobs (private; ``dsa bench indexer --variants`` sweeps them): ``block_s``
    keys and ``block_t`` query tokens a tile (None: ``256 / HI_PAD``, the dot's N dim 256), warps,
    pipeline ``stages`` (None: 3), ``tma`` (TMA loads of the keys and scales), ``waves`` (programs per
    SM to aim for). ``hopper_kernel``: the Gluon kernel of ``indexer_logits_ragged_hopper`` instead, one
    program a SM (``stages`` its key buffers, None: ``hopper.STAGES``; the other knobs are the
    portable kernel's)."""
    t, hi, di = q8.shape
    s = k8.shape[0]
    logits = torch.empty((t, s), dtype=torch.float32, device=q8.device)
    if t == 0 or s == 0:
        return logits
    q8, weights, k8, k_scale = q8.contiguous(), weights.contiguous(), k8.contiguous(), k_scale.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    if hopper_kernel:
        grid, tiles_per_prog = wave_grid(t, s, hopper.DOT_N // hi, hopper.BLOCK_S, sm_count(q8.device))
        return hopper.indexer_logits_ragged_hopper(q8, weights, k8, k_scale, starts, ends, logits, grid, tiles_per_prog,
                                                   stages=stages or hopper.STAGES)
    stages = stages or 3
    # the dot's N dim BLOCK_T * HI_PAD = 256 (one wgmma; q reuse halves L2 reads per FLOP), 64 keys a
    # tile, one warpgroup: at the model's calls (2**26 logits a call: 1024 x 64K, 256 x 256K, 64 x 1M) 4 warps
    # took 1148 / 1141 / 1145 us a call against 8 warps' 1200 / 1211 / 1216 on the H200, the same logits bit
    # for bit (benchmarks/results/prefill-indexer-split-h200-2026-12-02*.json; before the one-wave grid,
    # 8 warps led at 4096 x 64K, 889 against 869 TFLOP/s)
    hi_pad = max(16, triton.next_power_of_2(hi))
    block_t = max(1, 256 // hi_pad) if block_t is None else block_t
    grid, tiles_per_prog = ragged_grid(t, s, block_t, block_s, waves * sm_count(q8.device))
    keys, scales = k8, k_scale
    # one variant per (HI, DI, tiles, tma): T, S and tiles_per_prog change per step (runtime values, so the
    # logits' row starts are not known to be aligned); q8 rows are HI * DI >= 32 bytes, so any row slice
    # q8[r0:r1] stays 16-byte aligned, but weights rows (HI * 4 bytes), starts and ends (plan views at any
    # int32 offset) may not: those three are not specialized on their alignment
    if tma and di in (64, 128) and k8.data_ptr() % 16 == 0 and k_scale.data_ptr() % 16 == 0:
        keys = TensorDescriptor(k8, [s, di], [di, 1], [block_s, di])
        scales = TensorDescriptor(k_scale, [s], [1], [block_s])
    _indexer_logits_ragged_kernel[grid](
        q8, weights, keys, scales, starts, ends, logits, t, s, tiles_per_prog,
        HI=hi, HI_PAD=hi_pad, BLOCK_T=block_t, D=di, BLOCK_S=block_s, TMA=keys is not k8, STAGES=stages,
        num_warps=num_warps, num_stages=stages)
    return logits


def indexer_logits_ragged(q8: torch.Tensor, weights: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor | None,
                          starts: torch.Tensor, ends: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Indexer logits of prefill rows against ``S`` contiguous keys.

    Args:
        q8: ``[T, HI, DI]`` float8_e4m3fn (or a float dtype for exact precision, reference only).
        weights: ``[T, HI]`` float32 head weights (query scales folded in).
        k8: ``[S, DI]`` float8_e4m3fn keys (from ``gather_indexer_keys``), or float for exact.
        k_scale: ``[S]`` float32 key scales; ``None`` only with float (exact) keys.
        starts, ends: ``[T]`` int32, row ``t`` scores columns ``[starts[t], ends[t])``.

    Returns:
        ``logits [T, S]`` float32, ``sum_h weights[t, h] * relu(q8[t, h] . k8[s]) * k_scale[s]``
        inside each row's range and ``-inf`` outside. The caller bounds ``T * S`` by chunking.

    The Triton kernel (CUDA, FP8 keys; ``1 <= HI <= 128``, ``DI`` in 32..256) tiles ``T`` by
    ``256 / HI`` tokens and ``S`` by 64 keys, scores each tile with one FP8 ``tl.dot`` and skips
    tiles outside every row's range. Logits match the reference to fp32 summation order.

    ``backend="auto"`` runs the Gluon kernel of ``indexer_logits_ragged_hopper`` on sm_90 where it
    can (``HI`` a power of two in 16..128, ``DI = 128``): the FP8 dot of one warpgroup overlapped
    with the epilogue of another, the portable kernel's logits bit for bit (the same head-sum order);
    ``"hopper"`` asks for it (ValueError where it cannot run), ``"triton"`` keeps the portable kernel.

    ``backend="deepgemm"`` (only when asked, never by ``"auto"``; ``kernels/deepgemm.py`` gives its
    Hopper limits) runs DeepGEMM's ``fp8_mqa_logits`` with the same contract and another summation
    order.
    """
    check_tensor("q8", q8, shape=3)
    t, hi, di = q8.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, hi))
    check_tensor("k8", k8)
    exact = k8.is_floating_point() and k8.dtype != torch.float8_e4m3fn
    check_tensor("k8", k8, shape=(None, di))
    if exact:
        check_tensor("q8", q8, dtype=(torch.bfloat16, torch.float32, torch.float64))
        if k_scale is not None:
            check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    else:
        check_tensor("q8", q8, dtype=torch.float8_e4m3fn)
        check_tensor("k8", k8, dtype=torch.float8_e4m3fn)
        check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    check_tensor("starts", starts, dtype=torch.int32, shape=(t,))
    check_tensor("ends", ends, dtype=torch.int32, shape=(t,))
    device = check_same_device(q8=q8, weights=weights, k8=k8, k_scale=k_scale, starts=starts, ends=ends)
    if backend == "deepgemm":
        if exact:
            raise TypeError("indexer_logits_ragged: backend='deepgemm' takes FP8 queries and keys")
        return deepgemm.logits_ragged(q8, weights, k8, k_scale, starts, ends)
    use_hopper = not exact and hopper.use_hopper(backend, device, hi, di, (q8, k8))  # raises if "hopper" cannot run
    impl = resolve_backend("triton" if backend == "hopper" else backend, device, "indexer_logits_ragged",
                           triton_dtypes_ok=not exact)
    if impl == "torch":
        return indexer_logits_ragged_reference(q8, weights, k8, k_scale, starts, ends)
    if not 1 <= hi <= 128 or di not in (32, 64, 128, 256):
        raise ValueError(f"q8: the Triton kernel takes 1 <= HI <= 128 and DI in 32, 64, 128, 256; got shape "
                         f"{list(q8.shape)}")
    return _indexer_logits_ragged_triton(q8, weights, k8, k_scale, starts, ends, hopper_kernel=use_hopper)
