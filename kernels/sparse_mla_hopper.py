"""Hopper (sm_90) path of ``sparse_mla`` and ``dense_mla_decode``: a warp-specialized Gluon kernel.

The same function as the portable Triton kernel in ``sparse_mla.py`` (same inputs, outputs, -1 and
empty-row rules, LSE, slots outside ``[0, NB*P)`` and block ids outside ``[0, NB)`` read nothing),
scheduled the way Hopper wants it. One program (CTA) owns 64 query rows and a range of key tiles of
64 rows each, taken in pairs:

- a producer warpgroup gathers the key rows of tile ``2j`` into buffer 0 and of tile ``2j+1`` into
  buffer 1 (``cp.async``; FP8 rows are dequantized to bf16 on the way to shared memory), each buffer
  in two halves (V columns ``[0, 256)``; the rest) with their own ready/free mbarriers, so a half is
  refilled as soon as the warpgroups that read it are done with it;
- consumer warpgroup 0 computes ``S = Q K^T`` of tile ``2j`` and owns output columns ``[0, 256)``;
  consumer warpgroup 1 computes ``S`` of tile ``2j+1`` and owns columns ``[256, 512)``. No QK product
  is computed twice, and each warpgroup's fp32 accumulator is ``[64, 256]`` (128 registers a thread).
  They exchange their row maxima and their bf16 probabilities through shared memory, so each
  warpgroup multiplies both tiles' P by its half of V: its own P from registers, the other's from
  shared memory. The next tile's QK product is issued before the previous PV product is waited on.

The online softmax runs in the log2 domain with fp32 statistics, as in the portable kernel; results
agree with it to rounding (different summation order), not bitwise. Needs ``H`` a multiple of 64 (a
program's rows are 64 heads of one token), bf16 queries, a bf16 or FP8-656 cache. The public ops
keep the portable kernel where Gluon cannot be imported (:data:`AVAILABLE`) and on Triton releases
this kernel has not run on (:data:`TESTED_TRITON`; it also compiles on 3.9).
"""
import torch

from .common import choose_hopper, hopper_platform_reason
from .layouts import LATENT_FP8_ROPE_OFFSET, LATENT_FP8_SCALE_OFFSET
from .mla_split import split_launch

try:  # Gluon's API moves between Triton releases; without it this path is simply not offered
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    AVAILABLE = hasattr(gl, "warp_specialize") and hasattr(async_copy, "mbarrier_arrive")
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

BLOCK_H = 64  # query rows per program: one wgmma M
BLOCK_N = 64  # key rows per tile
TESTED_TRITON = ("3.6",)  # Triton releases this kernel has run on (it also compiles on 3.9)


def unsupported_reason(device: torch.device, h: int, tensors: tuple = (), capability: tuple[int, int] | None = None,
                       triton_version: str | None = None) -> str | None:
    """Why the Hopper kernel cannot serve a call, or None when it can: it needs Gluon on a tested Triton
    release, an sm_90 device, ``H`` a multiple of 64 (a program's rows are 64 heads of one token) and
    a contiguous, 16-byte aligned cache (``tensors``; rows are copied 16 bytes at a time).
    ``capability`` and ``triton_version`` default to the device's and the installed ones."""
    missing = "Gluon (triton.experimental.gluon) with warp specialization is not importable"
    reason = hopper_platform_reason(AVAILABLE, missing, TESTED_TRITON, device, capability, triton_version)
    if reason is not None:
        return reason
    if h % BLOCK_H != 0:
        return f"it takes H a multiple of {BLOCK_H}, got H={h}"
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 16 != 0:
            return "it takes a contiguous, 16-byte aligned latent_cache"
    return None


def use_hopper(backend: str, device: torch.device, h: int, tensors: tuple = (), capability=None) -> bool:
    """Whether a call that runs a Triton kernel runs this one: ``backend="hopper"`` asks for it (and
    raises ValueError where it cannot run), ``"auto"`` takes it where it can run, ``"triton"`` keeps the
    portable kernel."""
    return choose_hopper(backend, lambda: unsupported_reason(device, h, tensors, capability))


if AVAILABLE:
    # the names Triton 3.6 and 3.9 give the same operations
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier  # bar.sync of a partition's warps
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # cp.async
    _SCALE_OFF = gl.constexpr(LATENT_FP8_SCALE_OFFSET)
    _ROPE_OFF = gl.constexpr(LATENT_FP8_ROPE_OFFSET)

    # barrier indices (one shared [NUM_BARS, 1] int64 allocation)
    _Q_READY = gl.constexpr(0)
    _K0L_READY = gl.constexpr(1)
    _K0R_READY = gl.constexpr(2)
    _K1L_READY = gl.constexpr(3)
    _K1R_READY = gl.constexpr(4)
    _K0L_FREE = gl.constexpr(5)
    _K0R_FREE = gl.constexpr(6)
    _K1L_FREE = gl.constexpr(7)
    _K1R_FREE = gl.constexpr(8)
    _M0 = gl.constexpr(9)  # warpgroup 0 wrote its row max of the pair
    _M1 = gl.constexpr(10)  # warpgroup 1 wrote the pair's final row max
    _P0 = gl.constexpr(11)  # warpgroup 0 wrote P of tile 2j (rescaled to the pair's max)
    _P1 = gl.constexpr(12)  # warpgroup 1 wrote P of tile 2j+1
    _L0 = gl.constexpr(13)  # final row sums
    _L1 = gl.constexpr(14)
    _NUM_BARS = gl.constexpr(15)

    @gluon.jit
    def _key_range(seq_lens_ptr, g, hb, H, N, K, MB, block_size, SPLIT_TILES, DENSE: gl.constexpr):
        """(first tile, number of tiles, key end) of this program; rows of a program share one bound."""
        if DENSE:
            n = (hb * 64) // H  # the query token of request g these 64 rows belong to
            seq_len = gl.load(seq_lens_ptr + g)
            end = gl.minimum(seq_len - N + n + 1, MB * block_size)  # positions [0, end) are visible
            end = gl.maximum(end, 0)
        else:
            end = K
        split = gl.program_id(2)
        tile_lo = split * SPLIT_TILES
        tile_hi = gl.minimum(tile_lo + SPLIT_TILES, gl.cdiv(end, 64))
        num_tiles = gl.maximum(tile_hi - tile_lo, 0)
        key_end = gl.minimum(end, tile_hi * 64)
        return tile_lo, num_tiles, key_end

    @gluon.jit
    def _tile_rows(slots_ptr, block_table_ptr, g, tile, key_end, num_slots, NB, stride_slots, stride_bt,
                   stride_cb, stride_cp, block_size, rows, DENSE: gl.constexpr, ELEM_BYTES: gl.constexpr):
        """Cache offsets (elements for bf16, bytes for FP8) and validity of the 64 key rows of ``tile``."""
        idx = tile * 64 + rows
        in_range = idx < key_end
        if DENSE:
            blk = gl.load(block_table_ptr + g * stride_bt + idx // block_size, mask=in_range, other=-1)
            valid = in_range & (blk >= 0) & (blk < NB)
            blk = gl.where(valid, blk, 0).to(gl.int64)
            off = blk * stride_cb + (idx % block_size).to(gl.int64) * stride_cp
        else:
            slot = gl.load(slots_ptr + g * stride_slots + idx, mask=in_range, other=-1)
            valid = (slot >= 0) & (slot < num_slots)
            slot = gl.where(valid, slot, 0).to(gl.int64)
            off = (slot // block_size) * stride_cb + (slot % block_size) * stride_cp
        # rows start 16 bytes apart at least (a contiguous cache: 1152 or 656 bytes a row)
        return gl.multiple_of(off, 16 // ELEM_BYTES), valid

    @gluon.jit
    def _load_fp8_half(cache_ptr, off, valid, cols, RIGHT: gl.constexpr):
        """FP8 values of one half of 64 key rows (4 x [64, 64] bytes) and its two tile scales, zeros for
        rows not ``valid``."""
        c0: gl.constexpr = 256 if RIGHT else 0
        base = cache_ptr + off  # uint8 row pointers
        m = valid[:, None]
        x0 = gl.load(base[:, None] + (c0 + cols)[None, :], mask=m, other=0)
        x1 = gl.load(base[:, None] + (c0 + 64 + cols)[None, :], mask=m, other=0)
        x2 = gl.load(base[:, None] + (c0 + 128 + cols)[None, :], mask=m, other=0)
        x3 = gl.load(base[:, None] + (c0 + 192 + cols)[None, :], mask=m, other=0)
        sc_lo = gl.load((base + _SCALE_OFF + 4 * (c0 // 128)).to(gl.pointer_type(gl.float32)), mask=valid, other=0.0)
        sc_hi = gl.load((base + _SCALE_OFF + 4 * (c0 // 128 + 1)).to(gl.pointer_type(gl.float32)), mask=valid,
                        other=0.0)
        return x0, x1, x2, x3, sc_lo, sc_hi

    @gluon.jit
    def _fp8_to_bf16(x, scale):
        """``e4m3 value * scale`` rounded to bf16: the portable kernel's dequantization."""
        return (x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]).to(gl.bfloat16)

    @gluon.jit
    def _store_fp8_half(data, cache_ptr, off, valid, dst_n, dst_r, cols, RIGHT: gl.constexpr):
        """Dequantized values of one half into shared memory, plus (right half) the bf16 rope columns."""
        c0: gl.constexpr = 256 if RIGHT else 0
        x0, x1, x2, x3, sc_lo, sc_hi = data
        dst_n.slice(c0, 64, dim=1).store(_fp8_to_bf16(x0, sc_lo))
        dst_n.slice(c0 + 64, 64, dim=1).store(_fp8_to_bf16(x1, sc_lo))
        dst_n.slice(c0 + 128, 64, dim=1).store(_fp8_to_bf16(x2, sc_hi))
        dst_n.slice(c0 + 192, 64, dim=1).store(_fp8_to_bf16(x3, sc_hi))
        if RIGHT:
            pe = (cache_ptr + off + _ROPE_OFF).to(gl.pointer_type(gl.bfloat16))
            _async_load(dst_r, pe[:, None] + cols[None, :], mask=valid[:, None])
        fence_async_shared()  # generic-proxy stores, read by wgmma

    @gluon.jit
    def _copy_bf16_half(cache_ptr, off, valid, dst_n, dst_r, cols, RIGHT: gl.constexpr):
        """cp.async one half of 64 bf16 key rows: V columns [0, 256) (left) or [256, 512) plus the 64
        rope columns (right); rows not ``valid`` are zero-filled."""
        c0: gl.constexpr = 256 if RIGHT else 0
        base = cache_ptr + off  # bf16 row pointers
        m = valid[:, None]
        for c in gl.static_range(4):
            _async_load(dst_n.slice(c0 + 64 * c, 64, dim=1), base[:, None] + (c0 + 64 * c + cols)[None, :], mask=m)
        if RIGHT:
            _async_load(dst_r, base[:, None] + (512 + cols)[None, :], mask=m)

    @gluon.jit
    def _fill_half(cache_ptr, off, valid, dst_n, dst_r, cols, RIGHT: gl.constexpr, FP8: gl.constexpr):
        """One half of 64 key rows into its buffer (loads issued once the buffer is free: an FP8 half
        loaded ahead, while the previous one is stored, spills the producer's registers)."""
        if FP8:
            _store_fp8_half(_load_fp8_half(cache_ptr, off, valid, cols, RIGHT), cache_ptr, off, valid, dst_n, dst_r,
                            cols, RIGHT)
        else:
            _copy_bf16_half(cache_ptr, off, valid, dst_n, dst_r, cols, RIGHT)

    @gluon.jit
    def _signal(bar):
        """Arrive on a ready barrier (count 129) once this thread's copies land, and once more, from one
        thread, after every thread's shared-memory stores are done."""
        async_copy.mbarrier_arrive(bar, increment_count=False)
        _sync()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _producer(q_ptr, cache_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, H, N, K, MB, NB, num_slots,
                  SPLIT_TILES, ROWS, stride_slots, stride_bt, stride_cb, stride_cp, block_size,
                  bQn, bQr, bK0n, bK0r, bK1n, bK1r, bP1, sM, sL, sValid, bars,
                  DENSE: gl.constexpr, FP8: gl.constexpr):
        """Fill the key buffers in the order the consumers need the halves: tile 2j's left half, tile
        2j+1's right half, tile 2j's right half, tile 2j+1's left half. (An L2 prefetch of the next
        pair's rows, issued here, measured slower on the H200: 124 vs 106 us for the B=64 decode.)"""
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] bf16: 16 bytes a thread
        EB: gl.constexpr = 1 if FP8 else 2  # bytes of a cache element as the row offsets count them
        sQn, sQr, sK0n, sK0r = bQn.index(0), bQr.index(0), bK0n.index(0), bK0r.index(0)
        sK1n, sK1r = bK1n.index(0), bK1r.index(0)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
        g = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)
        tile_lo, num_tiles, key_end = _key_range(seq_lens_ptr, g, hb, H, N, K, MB, block_size, SPLIT_TILES, DENSE)

        q_row = q_ptr + (g * ROWS + hb * 64 + rows).to(gl.int64) * 576
        for c in gl.static_range(8):
            _async_load(sQn.slice(64 * c, 64, dim=1), q_row[:, None] + (64 * c + cols)[None, :])
        _async_load(sQr, q_row[:, None] + (512 + cols)[None, :])
        _signal(bars.index(_Q_READY))

        for j in range(gl.cdiv(num_tiles, 2)):
            ph = (j & 1) ^ 1  # free barriers start out complete
            t0 = tile_lo + 2 * j
            off0, valid0 = _tile_rows(slots_ptr, block_table_ptr, g, t0, key_end, num_slots, NB, stride_slots,
                                      stride_bt, stride_cb, stride_cp, block_size, rows, DENSE, EB)
            off1, valid1 = _tile_rows(slots_ptr, block_table_ptr, g, t0 + 1, key_end, num_slots, NB, stride_slots,
                                      stride_bt, stride_cb, stride_cp, block_size, rows, DENSE, EB)
            bias0 = gl.where(valid0, 0.0, float("-inf"))
            bias1 = gl.where(valid1, 0.0, float("-inf"))
            mbarrier.wait(bars.index(_K0L_FREE), ph)
            _fill_half(cache_ptr, off0, valid0, sK0n, sK0r, cols, False, FP8)
            sValid.index(0).store(bias0)
            _signal(bars.index(_K0L_READY))
            mbarrier.wait(bars.index(_K1R_FREE), ph)
            _fill_half(cache_ptr, off1, valid1, sK1n, sK1r, cols, True, FP8)
            sValid.index(1).store(bias1)
            _signal(bars.index(_K1R_READY))
            mbarrier.wait(bars.index(_K0R_FREE), ph)
            _fill_half(cache_ptr, off0, valid0, sK0n, sK0r, cols, True, FP8)
            _signal(bars.index(_K0R_READY))
            mbarrier.wait(bars.index(_K1L_FREE), ph)
            _fill_half(cache_ptr, off1, valid1, sK1n, sK1r, cols, False, FP8)
            _signal(bars.index(_K1L_READY))

    @gluon.jit
    def _finish(o, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sL, bars, row0, TOTAL_ROWS,
                WG: gl.constexpr, SPLIT: gl.constexpr):
        """Add the other warpgroup's row sums, normalize this warpgroup's half of the output, store it
        (and, from warpgroup 1, the LSE)."""
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        sL.index(WG).store(l_i)
        _sync()
        mbarrier.arrive(bars.index(_L0 + WG), count=1)
        mbarrier.wait(bars.index(_L1 - WG), 0)
        l_sum = l_i + sL.index(1 - WG).load(ROW)
        empty = l_sum == 0.0
        inv = 1.0 / gl.where(empty, 1.0, l_sum)
        inv_o = gl.convert_layout(inv, gl.SliceLayout(1, O_L))
        o = o * inv_o[:, None]
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        d = gl.arange(0, 256, layout=gl.SliceLayout(0, O_L))
        row = (row0 + r).to(gl.int64)
        lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_sum)))
        rr = gl.arange(0, 64, layout=ROW)
        if SPLIT:
            split = gl.program_id(2)
            gl.store(part_out_ptr + (split * TOTAL_ROWS + row)[:, None] * 512 + (WG * 256 + d)[None, :], o)
            if WG == 1:
                gl.store(part_lse_ptr + split * TOTAL_ROWS + row0 + rr, lse2)
        else:
            gl.store(out_ptr + row[:, None] * 512 + (WG * 256 + d)[None, :], o.to(gl.bfloat16))
            if WG == 1:
                gl.store(lse_ptr + row0 + rr, lse2 * 0.6931471805599453)

    @gluon.jit
    def _consumer0(q_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                   scale_log2, H, N, K, MB, block_size, SPLIT_TILES, ROWS, TOTAL_ROWS,
                   bQn, bQr, bK0n, bK0r, bK1n, bK1r, bP1, sM, sL, sValid, bars,
                   DENSE: gl.constexpr, SPLIT: gl.constexpr):
        """Warpgroup 0: S of tiles 2j, output columns [0, 256)."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        OROW: gl.constexpr = gl.SliceLayout(1, O_L)
        g = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)
        tile_lo, num_tiles, key_end = _key_range(seq_lens_ptr, g, hb, H, N, K, MB, block_size, SPLIT_TILES, DENSE)
        s_zero = gl.zeros([64, 64], gl.float32, S_L)
        o = gl.zeros([64, 256], gl.float32, O_L)
        m_i = gl.full([64], float("-inf"), gl.float32, ROW)
        l_i = gl.zeros([64], gl.float32, ROW)
        mbarrier.wait(bars.index(_Q_READY), 0)
        for j in range(gl.cdiv(num_tiles, 2)):
            ph = j & 1
            # views through an index the compiler cannot prove constant (j < 2**30): keeps the ~150
            # shared-memory descriptors of a pair from being hoisted out of the loop and spilled
            z = j >> 30
            sQn, sQr, sK0n, sK0r = bQn.index(z), bQr.index(z), bK0n.index(z), bK0r.index(z)
            sK1n, sK1r, sP1 = bK1n.index(z), bK1r.index(z), bP1.index(z)
            mbarrier.wait(bars.index(_K0L_READY), ph)
            s = warpgroup_mma(sQn.slice(0, 256, dim=1), sK0n.slice(0, 256, dim=1).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            o = warpgroup_mma_wait(1, deps=[o])  # the previous pair's second PV product is done
            _sync()
            mbarrier.arrive(bars.index(_K1L_FREE), count=1, pred=j > 0)
            mbarrier.wait(bars.index(_K0R_READY), ph)
            s = warpgroup_mma(sQn.slice(256, 256, dim=1), sK0n.slice(256, 256, dim=1).permute((1, 0)), s,
                              is_async=True)
            s = warpgroup_mma(sQr, sK0r.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            bias = sValid.index(0).load(gl.SliceLayout(0, S_L))
            t = s * scale_log2 + bias[None, :]
            m_new = gl.maximum(m_i, gl.max(t, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(t - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            sM.store(m_new)
            _sync()
            mbarrier.arrive(bars.index(_M0), count=1)
            o = o * gl.convert_layout(alpha, OROW)[:, None]
            p_op = gl.convert_layout(p.to(gl.bfloat16), P_L)
            o = warpgroup_mma(p_op, sK0n.slice(0, 256, dim=1), o, is_async=True)
            o, p_op = warpgroup_mma_wait(0, deps=[o, p_op])
            _sync()
            mbarrier.arrive(bars.index(_K0L_FREE), count=1)
            mbarrier.wait(bars.index(_M1), ph)
            m_pair = sM.load(ROW)  # max over both tiles, from warpgroup 1
            m_pair_use = gl.where(m_pair == float("-inf"), 0.0, m_pair)
            beta = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_use - m_pair_use))
            sK0r.store((p * beta[:, None]).to(gl.bfloat16))  # the rope columns of tile 2j are no longer read
            fence_async_shared()
            _sync()
            mbarrier.arrive(bars.index(_P0), count=1)
            o = o * gl.convert_layout(beta, OROW)[:, None]
            l_i = l_i * beta
            m_i = m_pair
            mbarrier.wait(bars.index(_P1), ph)
            o = warpgroup_mma(sP1, sK1n.slice(0, 256, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(1, deps=[o])  # left in flight: waited for at the next pair's start
        o = warpgroup_mma_wait(0, deps=[o])
        row0 = g * ROWS + hb * 64
        _finish(o, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sL, bars, row0, TOTAL_ROWS, 0, SPLIT)

    @gluon.jit
    def _consumer1(q_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                   scale_log2, H, N, K, MB, block_size, SPLIT_TILES, ROWS, TOTAL_ROWS,
                   bQn, bQr, bK0n, bK0r, bK1n, bK1r, bP1, sM, sL, sValid, bars,
                   DENSE: gl.constexpr, SPLIT: gl.constexpr):
        """Warpgroup 1: S of tiles 2j+1, output columns [256, 512)."""
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        OROW: gl.constexpr = gl.SliceLayout(1, O_L)
        g = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1)
        tile_lo, num_tiles, key_end = _key_range(seq_lens_ptr, g, hb, H, N, K, MB, block_size, SPLIT_TILES, DENSE)
        s_zero = gl.zeros([64, 64], gl.float32, S_L)
        o = gl.zeros([64, 256], gl.float32, O_L)
        m_i = gl.full([64], float("-inf"), gl.float32, ROW)
        l_i = gl.zeros([64], gl.float32, ROW)
        mbarrier.wait(bars.index(_Q_READY), 0)
        for j in range(gl.cdiv(num_tiles, 2)):
            ph = j & 1
            # views through an index the compiler cannot prove constant (j < 2**30): keeps the ~150
            # shared-memory descriptors of a pair from being hoisted out of the loop and spilled
            z = j >> 30
            sQn, sQr, sK0n, sK0r = bQn.index(z), bQr.index(z), bK0n.index(z), bK0r.index(z)
            sK1n, sK1r, sP1 = bK1n.index(z), bK1r.index(z), bP1.index(z)
            mbarrier.wait(bars.index(_K1R_READY), ph)
            s = warpgroup_mma(sQn.slice(256, 256, dim=1), sK1n.slice(256, 256, dim=1).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            s = warpgroup_mma(sQr, sK1r.permute((1, 0)), s, is_async=True)
            mbarrier.wait(bars.index(_K1L_READY), ph)
            s = warpgroup_mma(sQn.slice(0, 256, dim=1), sK1n.slice(0, 256, dim=1).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            bias = sValid.index(1).load(gl.SliceLayout(0, S_L))
            t = s * scale_log2 + bias[None, :]
            mbarrier.wait(bars.index(_M0), ph)
            m_new = gl.maximum(sM.load(ROW), gl.max(t, 1))  # >= m_i: warpgroup 0 started from it
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(t - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            _sync()  # every row max of warpgroup 0 is read before it is overwritten
            sM.store(m_new)
            _sync()
            mbarrier.arrive(bars.index(_M1), count=1)
            o = o * gl.convert_layout(alpha, OROW)[:, None]
            p_bf = p.to(gl.bfloat16)
            p_op = gl.convert_layout(p_bf, P_L)
            o = warpgroup_mma(p_op, sK1n.slice(256, 256, dim=1), o, is_async=True)
            sP1.store(p_bf)
            fence_async_shared()
            mbarrier.wait(bars.index(_P0), ph)
            o = warpgroup_mma(sK0r, sK0n.slice(256, 256, dim=1), o, is_async=True)
            _sync()
            mbarrier.arrive(bars.index(_P1), count=1)
            o, p_op = warpgroup_mma_wait(1, deps=[o, p_op])
            _sync()
            mbarrier.arrive(bars.index(_K1R_FREE), count=1)
            o = warpgroup_mma_wait(0, deps=[o])
            _sync()
            mbarrier.arrive(bars.index(_K0R_FREE), count=1)
            m_i = m_new
        row0 = g * ROWS + hb * 64
        _finish(o, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sL, bars, row0, TOTAL_ROWS, 1, SPLIT)

    # integer arguments are not specialized on their values, nor the int tables (views of the step's
    # plan at any int32 offset) on their alignment: one compiled kernel per (DENSE, FP8, SPLIT)
    @gluon.jit(do_not_specialize=["ROWS", "H", "N", "K", "MB", "NB", "num_slots", "TOTAL_ROWS", "SPLIT_TILES",
                                  "stride_slots", "stride_bt", "stride_cb", "stride_cp", "block_size"],
               do_not_specialize_on_alignment=["slots_ptr", "block_table_ptr", "seq_lens_ptr"])
    def _mla_hopper_kernel(q_ptr, cache_ptr, slots_ptr, block_table_ptr, seq_lens_ptr,
                           out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, scale_log2,
                           ROWS, H, N, K, MB, NB, num_slots, TOTAL_ROWS, SPLIT_TILES,
                           stride_slots, stride_bt, stride_cb, stride_cp, block_size,
                           DENSE: gl.constexpr, FP8: gl.constexpr, SPLIT: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Program (g, hb, split): 64 query rows ``hb`` of group ``g`` over its ``split``-th range of
        key tiles. Sparse: a group is a token, keys its slots. Dense: a group is a request, keys its
        visible positions."""
        NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        sQn = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 512], NV)
        sQr = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 64], NV)
        sK0n = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 512], NV)
        sK0r = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 64], NV)  # also P of tile 2j once S is done
        sK1n = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 512], NV)
        sK1r = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 64], NV)
        sP1 = gl.allocate_shared_memory(gl.bfloat16, [1] + [64, 64], NV)
        sM = gl.allocate_shared_memory(gl.float32, [64], FLAT)
        sL = gl.allocate_shared_memory(gl.float32, [2, 64], FLAT)
        sValid = gl.allocate_shared_memory(gl.float32, [2, 64], FLAT)
        bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_NUM_BARS):
            if i <= _K1R_READY:
                mbarrier.init(bars.index(i), count=129)  # 128 threads' copies + one arrive after the stores
            else:
                mbarrier.init(bars.index(i), count=1)
        # (argument tuples written inline: a tuple assigned to a name would turn its constexprs into tensors)
        gl.warp_specialize([
            (_consumer0, (q_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                          scale_log2, H, N, K, MB, block_size, SPLIT_TILES, ROWS, TOTAL_ROWS,
                          sQn, sQr, sK0n, sK0r, sK1n, sK1r, sP1, sM, sL, sValid, bars, DENSE, SPLIT)),
            (_consumer1, (q_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                          scale_log2, H, N, K, MB, block_size, SPLIT_TILES, ROWS, TOTAL_ROWS,
                          sQn, sQr, sK0n, sK0r, sK1n, sK1r, sP1, sM, sL, sValid, bars, DENSE, SPLIT)),
            (_producer, (q_ptr, cache_ptr, slots_ptr, block_table_ptr, seq_lens_ptr, H, N, K, MB, NB, num_slots,
                         SPLIT_TILES, ROWS, stride_slots, stride_bt, stride_cb, stride_cp, block_size,
                         sQn, sQr, sK0n, sK0r, sK1n, sK1r, sP1, sM, sL, sValid, bars, DENSE, FP8)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


CONSUMER_REGS = 200  # 128 accumulator + 32 score + 16 probability registers a thread, and the rest
PRODUCER_REGS = 104  # the FP8 dequantization's loads in flight; 2 * 200 + 104 = 3 * 168
MAX_REGS = (2 * CONSUMER_REGS + PRODUCER_REGS) // 3  # the kernel-wide limit the partitions' shares add up to


def mla_attention_hopper(q_rows, latent_cache, rows, groups, *, slots=None, block_table=None, seq_lens=None, n=1,
                         h=None, length, softmax_scale, splits=None):
    """Run the Hopper kernel over ``groups x rows`` query rows ``q_rows [groups * rows, 576]`` bf16
    (``rows`` a multiple of 64); arguments as ``mla_attention_triton``'s. Grids smaller than the GPU
    split the key tiles over programs, in pairs, and merge them by LSE (``mla_split``, as the portable
    kernel); ``splits`` overrides that choice (for measurements).
    Returns ``(out [groups * rows, 512] bf16, lse [groups * rows] fp32)``."""
    if q_rows.data_ptr() % 16 != 0:  # rows are copied 16 bytes at a time
        q_rows = q_rows.clone()
    launch = split_launch(q_rows, latent_cache, rows, groups, row_blocks=rows // BLOCK_H, block_n=BLOCK_N, granule=2,
                          split_in_keys=False, slots=slots, block_table=block_table, seq_lens=seq_lens, n=n, h=h,
                          length=length, softmax_scale=softmax_scale, splits=splits)
    if launch.grid is not None:
        # one variant per (DENSE, FP8, SPLIT): no int argument specializes (the kernel's do_not_specialize),
        # q_rows is copied above when it is not 16-byte aligned and the int tables are not specialized on
        # their alignment
        grid = launch.grid
        _mla_hopper_kernel[grid](*launch.args, **launch.flags, CONSUMER_REGS=CONSUMER_REGS,
                                 PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAX_REGS)
    return launch.finish()
