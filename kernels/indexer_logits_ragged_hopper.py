"""Hopper (sm_90) path of ``indexer_logits_ragged``: a warp-specialized Gluon kernel.

The same function as the portable Triton kernel in ``indexer_logits_ragged.py`` (same inputs, the
same ``-inf`` outside each row's ``[start, end)``, tiles outside every row's range written without
being scored), scheduled so the FP8 dot and the per-tile epilogue overlap. One program (CTA) owns
``256 / HI`` query tokens (all their heads: the dot's N dim, 256) and a range of key tiles of 64
keys (the dot's M dim):

- a producer warp loads the tokens' queries once and the key tiles into a ring of ``STAGES`` (8)
  shared-memory buffers by TMA, each with its ready/free mbarrier;
- two consumer warpgroups take the tiles in turn (even tiles, odd tiles): each computes
  ``S = K Q^T`` of its tile with one wgmma (``[64, 256]`` fp32, 128 registers a thread), frees the
  buffer, and runs the epilogue (``relu``, head weights, the sum over heads, the key scale, the
  row ranges) while the other warpgroup's wgmma runs. In the portable kernel one warpgroup waits
  for its dot before its epilogue: the tensor cores idle for the epilogue's ~300 instructions a
  tile.

Its wgmma accumulator has the portable kernel's layout, so the head sum runs in the same order: the
logits are the portable kernel's bit for bit (``tests/test_indexer_kernels_gpu.py``, H200), and each
row's logits depend on that row alone. Needs ``HI`` a power of two in 16..128 and ``DI = 128``,
FP8 queries and keys. :func:`use_hopper` keeps the portable kernel where Gluon cannot be imported
(:data:`AVAILABLE`) and on Triton releases this kernel has not run on (:data:`TESTED_TRITON`).
"""
import torch

from .common import choose_hopper, hopper_platform_reason

try:  # Gluon's API moves between Triton releases; without it this path is simply not offered
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    AVAILABLE = hasattr(gl, "warp_specialize") and hasattr(tma, "async_copy_global_to_shared")  # 3.6 and 3.9
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

BLOCK_S = 64  # keys a tile: one wgmma M
DOT_N = 256  # query rows (tokens x heads) a program: one wgmma N
STAGES = 8  # key buffers in the ring (6-10 measured alike on the H200, 4 up to 12% slower)
TESTED_TRITON = ("3.6",)  # Triton releases this kernel has run on (it also compiles on 3.9)


def unsupported_reason(device: torch.device, hi: int, di: int, tensors: tuple = (),
                       capability: tuple[int, int] | None = None, triton_version: str | None = None) -> str | None:
    """Why the Hopper kernel cannot serve a call, or None when it can: Gluon on a tested Triton
    release, an sm_90 device, ``HI`` a power of two in 16..128, ``DI = 128`` and 16-byte aligned
    ``tensors`` (the TMA bases). ``capability`` and ``triton_version`` default to the device's and
    the installed ones."""
    missing = "Gluon (triton.experimental.gluon) with warp specialization and TMA is not importable"
    reason = hopper_platform_reason(AVAILABLE, missing, TESTED_TRITON, device, capability, triton_version)
    if reason is not None:
        return reason
    if hi not in (16, 32, 64, 128) or di != 128:
        return f"it takes HI in 16, 32, 64, 128 and DI = 128, got HI={hi}, DI={di}"
    for t in tensors:
        if t.data_ptr() % 16 != 0:
            return "it takes 16-byte aligned queries and keys (TMA)"
    return None


def use_hopper(backend: str, device: torch.device, hi: int, di: int, tensors: tuple = (), capability=None) -> bool:
    """Whether a call that runs a Triton kernel runs this one: ``backend="hopper"`` asks for it (and
    raises ValueError where it cannot run), ``"auto"`` takes it where it can run, ``"triton"`` keeps the
    portable kernel."""
    return choose_hopper(backend, lambda: unsupported_reason(device, hi, di, tensors, capability))


if AVAILABLE:
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier  # bar.sync of a partition's warps
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # the 3.9 name, the 3.6 one

    @gluon.jit
    def _key_range(starts_ptr, ends_ptr, num_tokens, num_keys, tiles_per_prog, BLOCK_T: gl.constexpr,
                   WARPS: gl.constexpr):
        """``(s_begin, s_end, c_begin, c_tiles)``: this program's keys ``[s_begin, s_end)`` and, inside
        them, the ``c_tiles`` tiles from ``c_begin`` (tile-aligned) that some row's range touches."""
        L: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # the calling partition's warps
        t = gl.program_id(0) * BLOCK_T + gl.arange(0, 32, layout=L)
        t_ok = (t < num_tokens) & (gl.arange(0, 32, layout=L) < BLOCK_T)
        start = gl.load(starts_ptr + t, mask=t_ok, other=num_keys)
        end = gl.load(ends_ptr + t, mask=t_ok, other=0)
        lo = gl.maximum(gl.min(start, axis=0), 0)
        hi = gl.minimum(gl.max(end, axis=0), num_keys)
        s_begin = gl.program_id(1) * tiles_per_prog * 64
        s_end = gl.minimum(s_begin + tiles_per_prog * 64, num_keys)
        c_begin = gl.minimum(gl.maximum(s_begin, lo // 64 * 64), s_end)
        c_tiles = gl.cdiv(gl.maximum(gl.minimum(s_end, hi), c_begin) - c_begin, 64)
        return s_begin, s_end, c_begin, c_tiles

    @gluon.jit
    def _producer(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                  tiles_per_prog, sQ, sK, bars, HI: gl.constexpr, BLOCK_T: gl.constexpr, NSTAGE: gl.constexpr):
        """The queries once, then the key tiles into the ring, a tile as soon as its buffer is free."""
        s_begin, s_end, c_begin, c_tiles = _key_range(starts_ptr, ends_ptr, num_tokens, num_keys, tiles_per_prog,
                                                      BLOCK_T, 1)
        q_ready = bars.index(0)
        mbarrier.expect(q_ready, 256 * 128)
        _tma_load(q_desc, [gl.program_id(0) * 256, 0], q_ready, sQ)
        for i in range(c_tiles):
            stage = i % NSTAGE
            mbarrier.wait(bars.index(1 + NSTAGE + stage), ((i // NSTAGE) & 1) ^ 1)  # free ones start complete
            ready = bars.index(1 + stage)
            mbarrier.expect(ready, 64 * 128)
            _tma_load(k_desc, [c_begin + i * 64, 0], ready, sK.index(stage))

    @gluon.jit
    def _consumer(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                  tiles_per_prog, sQ, sK, bars, HI: gl.constexpr, BLOCK_T: gl.constexpr, NSTAGE: gl.constexpr,
                  WG: gl.constexpr):
        """Warpgroup ``WG``: tiles ``WG, WG + 2, ...`` of the program's range, and its share of the
        ``-inf`` tiles around it."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 256, 32])
        zero = gl.zeros([64, 256], gl.float32, ACC)
        # [64 keys, BLOCK_T tokens]: the logits as they are stored, a token's keys across lanes (stored from
        # the layout the head sum leaves, four lanes a value, measured 1,202 against 1,159 us at 64 x 1M)
        OUT: gl.constexpr = gl.BlockedLayout([1, (BLOCK_T + 1) // 2], [16, 2], [4, 1], [0, 1])
        s_begin, s_end, c_begin, c_tiles = _key_range(starts_ptr, ends_ptr, num_tokens, num_keys, tiles_per_prog,
                                                      BLOCK_T, 4)
        col = gl.arange(0, 256, layout=gl.SliceLayout(0, ACC))
        q_row = gl.program_id(0).to(gl.int64) * 256 + col
        w = gl.load(w_ptr + q_row, mask=q_row < num_tokens * HI, other=0.0)  # [256] fp32
        t = gl.program_id(0) * BLOCK_T + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, OUT))
        t_ok = t < num_tokens
        start = gl.load(starts_ptr + t, mask=t_ok, other=num_keys)
        end = gl.load(ends_ptr + t, mask=t_ok, other=0)
        out_row = t.to(gl.int64) * num_keys  # [BLOCK_T]
        key = gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))
        minus_inf = gl.full([64, BLOCK_T], float("-inf"), gl.float32, OUT)
        head_tiles = (c_begin - s_begin) // 64
        for tile in range(WG, head_tiles, 2):
            pos = s_begin + tile * 64 + key
            gl.store(out_ptr + out_row[None, :] + pos[:, None], minus_inf, mask=t_ok[None, :] & (pos < s_end)[:, None])
        mbarrier.wait(bars.index(0), 0)
        for i in range(WG, c_tiles, 2):
            stage = i % NSTAGE
            pos = c_begin + i * 64 + key
            k_scale = gl.load(ks_ptr + pos, mask=pos < num_keys, other=0.0)  # [64] fp32, before the wait
            mbarrier.wait(bars.index(1 + stage), (i // NSTAGE) & 1)
            s = warpgroup_mma(sK.index(stage), sQ.permute((1, 0)), zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            _sync()
            mbarrier.arrive(bars.index(1 + NSTAGE + stage), count=1)
            s = gl.maximum(s, 0.0) * w[None, :]
            logit = gl.convert_layout(gl.sum(gl.reshape(s, [64, BLOCK_T, HI]), axis=2), OUT) * k_scale[:, None]
            inside = (pos[:, None] >= start[None, :]) & (pos[:, None] < end[None, :])
            logit = gl.where(inside, logit, float("-inf"))
            gl.store(out_ptr + out_row[None, :] + pos[:, None], logit, mask=t_ok[None, :] & (pos < s_end)[:, None])
        for tile in range(head_tiles + c_tiles + WG, tiles_per_prog, 2):
            pos = s_begin + tile * 64 + key
            gl.store(out_ptr + out_row[None, :] + pos[:, None], minus_inf, mask=t_ok[None, :] & (pos < s_end)[:, None])

    @gluon.jit
    def _consumer0(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                   tiles_per_prog, sQ, sK, bars, HI: gl.constexpr, BLOCK_T: gl.constexpr, NSTAGE: gl.constexpr):
        _consumer(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys, tiles_per_prog,
                  sQ, sK, bars, HI, BLOCK_T, NSTAGE, 0)

    @gluon.jit
    def _consumer1(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                   tiles_per_prog, sQ, sK, bars, HI: gl.constexpr, BLOCK_T: gl.constexpr, NSTAGE: gl.constexpr):
        _consumer(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys, tiles_per_prog,
                  sQ, sK, bars, HI, BLOCK_T, NSTAGE, 1)

    # T, S and tiles_per_prog change per step; weights, starts and ends are views at any offset
    @gluon.jit(do_not_specialize=["num_tokens", "num_keys", "tiles_per_prog"],
               do_not_specialize_on_alignment=["w_ptr", "starts_ptr", "ends_ptr"])
    def _ragged_hopper_kernel(q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                              tiles_per_prog, HI: gl.constexpr, NSTAGE: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Program (t tile, split): ``256 / HI`` tokens against key tiles ``[split * tiles_per_prog, ...)``."""
        BLOCK_T: gl.constexpr = 256 // HI
        NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        sQ = gl.allocate_shared_memory(gl.float8e4nv, [256, 128], NV)
        sK = gl.allocate_shared_memory(gl.float8e4nv, [NSTAGE, 64, 128], NV)
        bars = gl.allocate_shared_memory(gl.int64, [1 + 2 * NSTAGE, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(1 + 2 * NSTAGE):
            mbarrier.init(bars.index(i), count=1)
        gl.warp_specialize([
            (_consumer0, (q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                          tiles_per_prog, sQ, sK, bars, HI, BLOCK_T, NSTAGE)),
            (_consumer1, (q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                          tiles_per_prog, sQ, sK, bars, HI, BLOCK_T, NSTAGE)),
            (_producer, (q_desc, k_desc, starts_ptr, ends_ptr, w_ptr, ks_ptr, out_ptr, num_tokens, num_keys,
                         tiles_per_prog, sQ, sK, bars, HI, BLOCK_T, NSTAGE)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


CONSUMER_REGS = 232  # 128 accumulator registers a thread, the epilogue's and the addresses
PRODUCER_REGS = 40  # one warp issuing TMA copies (its warpgroup padded to 4 warps)
MAX_REGS = (2 * CONSUMER_REGS + PRODUCER_REGS) // 3  # 168: the kernel-wide limit of 3 warpgroups' registers


def indexer_logits_ragged_hopper(q8, weights, k8, k_scale, starts, ends, logits, grid, tiles_per_prog, *,
                                 stages: int = STAGES):
    """Fill ``logits [T, S]`` (arguments as ``indexer_logits_ragged``'s, validated and made contiguous
    there) over ``grid = (row tiles, key splits)`` of ``256 / HI`` tokens and ``tiles_per_prog`` key
    tiles a program (``wave_grid``; one program a SM: its 3 warpgroups hold the register file).
    ``stages``: key buffers in the ring (a tuning knob)."""
    t, hi, di = q8.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    q_desc = TensorDescriptor.from_tensor(q8.view(t * hi, di), [DOT_N, di], layout)
    k_desc = TensorDescriptor.from_tensor(k8, [BLOCK_S, di], layout)
    _ragged_hopper_kernel[grid](q_desc, k_desc, starts, ends, weights, k_scale, logits, t, k8.shape[0], tiles_per_prog,
                                HI=hi, NSTAGE=stages, CONSUMER_REGS=CONSUMER_REGS,
                                PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAX_REGS)
    return logits
