"""indexer_key_write: Hadamard (optional), ue8m0 FP8 quantization per token, planar store by slot.

A slot outside ``[0, NB * P)`` writes nothing; a key holding NaN or +-inf is stored as NaN (the rule of
``layouts``); both backends write the same bytes, without a host sync.
"""
import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_block_size, check_same_device, check_tensor, resolve_backend
from .layouts import (
    FP8_MAX,
    FP8_NAN_BYTE,
    FP32_NAN_BITS,
    INDEXER_AMAX_FLOOR,
    indexer_bytes_per_token,
    indexer_cache_views,
)
from .quant import hadamard_reference, quant_ue8m0_reference


def indexer_key_write_reference(index_cache, k, slot_mapping, block_size, hadamard):
    if hadamard:
        k = hadamard_reference(k)  # rounded to k's dtype, as the model stores it
    k8, scale = quant_ue8m0_reference(k, group=k.shape[-1])  # [T, DI] e4m3, [T, 1] fp32
    k8_cache, scale_cache = indexer_cache_views(index_cache, block_size)  # [NB, P, DI], [NB, P]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < index_cache.shape[0] * block_size)  # slots outside the cache: skipped
    block, offset = slots[keep] // block_size, slots[keep] % block_size
    k8_cache[block, offset] = k8[keep]
    scale_cache[block, offset] = scale[keep, 0]


AMAX_FLOOR = tl.constexpr(INDEXER_AMAX_FLOOR)
FP8_LIMIT = tl.constexpr(FP8_MAX)
NAN_BYTE = tl.constexpr(FP8_NAN_BYTE)
NAN_BITS = tl.constexpr(FP32_NAN_BITS)


# Shared with indexer_query_prep: the reference's arithmetic (kernels/quant.py), in the same order.
@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Butterfly stages h = 1, 2, ..., D/2 of each row of ``x [ROWS, D]`` fp32: within each group of
    2h, pairs (a, b) = (x[i], x[i + h]) -> (a + b, a - b), exactly as ``hadamard_reference``."""
    for stage in tl.static_range(LOG2_D):  # h = 2**stage
        y = tl.permute(tl.reshape(x, [ROWS, D >> (stage + 1), 2, 1 << stage]), [0, 1, 3, 2])  # [ROWS, G, h, 2]
        a, b = tl.split(y)  # [ROWS, G, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])
    return x


@triton.jit
def nan_to_canonical(x):
    """fp32 ``x`` with every NaN as ``0x7FC00000`` (GPU arithmetic makes 0x7FFFFFFF, CPUs keep payloads)."""
    return tl.where(x != x, tl.full(x.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True), x)


@triton.jit
def ue8m0_quant_rows(x):
    """``x [ROWS, D]`` fp32 -> (value bytes [ROWS, D] uint8 of e4m3, scale [ROWS] fp32) per row, as
    ``quant_ue8m0_reference``: r = max(amax, 1e-4) / 448 (IEEE division), scale = ue8m0(r) from the
    bits, values clamp(x / scale, -448, 448) (x times the exact power-of-two reciprocal). A row holding
    NaN or +-inf is NaN: bytes 0x7F, scale 0x7FC00000 (found by integer reductions, which mean the same
    on every backend; float max/min treat NaN differently on the GPU and in the interpreter)."""
    bad = tl.max((tl.abs(x) == float("inf")).to(tl.int32) | (x != x).to(tl.int32), axis=1) != 0  # [ROWS]
    amax = tl.max(tl.abs(x), axis=1)  # [ROWS]; any value for bad rows, which are overwritten
    r = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), tl.full(amax.shape, FP8_LIMIT, tl.float32))
    bits = r.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inv_scale = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # exactly 1 / scale
    v = tl.minimum(tl.maximum(x * inv_scale[:, None], -FP8_LIMIT), FP8_LIMIT)
    v8 = tl.where(bad[:, None], NAN_BYTE, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)).to(tl.uint8)
    scale = tl.where(bad, tl.full(scale.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True), scale)
    return v8, scale


@triton.jit(do_not_specialize=["num_tokens", "num_slots"], do_not_specialize_on_alignment=["slot_ptr"])
def _indexer_key_write_kernel(k_ptr, stride_kt, slot_ptr, val_ptr, scale_ptr, num_tokens, num_slots, stride_block,
                              hadamard_scale, P: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
                              BLOCK_T: tl.constexpr, HADAMARD: tl.constexpr):
    # one program: BLOCK_T tokens; stride_block = bytes per cache block (a multiple of 4); a slot
    # outside [0, num_slots) writes nothing
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] int64
    cols = tl.arange(0, D)
    in_range = rows < num_tokens
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1).to(tl.int64)  # [BLOCK_T]
    x = tl.load(k_ptr + rows[:, None] * stride_kt + cols[None, :], mask=in_range[:, None], other=0.0)
    x = x.to(tl.float32)  # [BLOCK_T, D]
    if HADAMARD:
        x = hadamard_rows(x, BLOCK_T, D, LOG2_D)
        x = (x * hadamard_scale).to(tl.bfloat16).to(tl.float32)  # one multiply, rounded to k's dtype
    k8, scale = ue8m0_quant_rows(x)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    block = tl.where(keep, slot // P, 0)
    offset = tl.where(keep, slot % P, 0)
    base = block * stride_block  # [BLOCK_T] int64 byte offset of the token's block
    tl.store(val_ptr + base[:, None] + offset[:, None] * D + cols[None, :], k8, mask=keep[:, None])
    tl.store(scale_ptr + base // 4 + P * D // 4 + offset, scale, mask=keep)


def _indexer_key_write_triton(index_cache, k, slot_mapping, block_size, hadamard):
    t, di = k.shape
    if t == 0:
        return
    k = k.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_t = 16
    # one variant per (P, DI, HADAMARD): the ints that specialize are stride_kt (= DI, k is contiguous) and
    # stride_block (P * (DI + 4) bytes), fixed by the model; num_tokens (per step) and num_slots are runtime
    # values, and slot_mapping (a view at any int32 offset) is not specialized on its alignment
    _indexer_key_write_kernel[(triton.cdiv(t, block_t),)](
        k, k.stride(0), slot_mapping, index_cache, index_cache.view(torch.float32), t,
        index_cache.shape[0] * block_size, index_cache.stride(0), di ** -0.5, P=block_size, D=di, LOG2_D=di.bit_length() - 1, BLOCK_T=block_t,
        HADAMARD=bool(hadamard), num_warps=4)


def indexer_key_write(index_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                      hadamard: bool, *, backend: str = "auto") -> None:
    """Quantize indexer keys and store them in the planar paged cache, in place.

    Args:
        index_cache: ``uint8 [NB, P * (DI + 4)]``, planar per block (``dsa.kernels.layouts``);
            contiguous for the Triton kernel. NB may be 0.
        k: ``[T, DI]`` bfloat16 (float32/float64 through the reference), after LayerNorm and RoPE;
            ``DI`` a power of two for the Triton kernel.
        slot_mapping: ``[T]`` int32/int64 slots ``block * P + offset``; a slot outside ``[0, NB * P)``
            (``-1``, any negative, ``NB * P`` or more) is skipped: nothing is written for that row.
        block_size: ``P`` (a multiple of 16 for the Triton kernel).
        hadamard: apply the ``DI``-point Hadamard transform (rounded to ``k``'s dtype) first.

    Each kept token gets ``DI`` e4m3 values ``clamp(k / s, -448, 448)`` at bytes
    ``[t * DI, (t + 1) * DI)`` of its block and ``s = ue8m0(max(amax, 1e-4) / 448)`` as fp32 at
    ``P * DI + 4 * t``; a key holding NaN or +-inf is stored as NaN (bytes ``0x7F``, scale
    ``0x7FC00000``). The Triton kernel (one launch, 16 tokens a program) writes the same bytes as
    the reference, whatever ``k`` holds. T = 0 writes nothing.
    """
    check_tensor("k", k, dtype=FLOAT_DTYPES, shape=2)
    t, di = k.shape
    if di < 1 or (hadamard and di & (di - 1)):
        raise ValueError(f"k: expected DI >= 1 (a power of two with hadamard), got shape {list(k.shape)}")
    block_size = check_block_size(block_size)
    check_tensor("index_cache", index_cache, dtype=torch.uint8, shape=(None, block_size * indexer_bytes_per_token(di)))
    check_tensor("slot_mapping", slot_mapping, dtype=INDEX_DTYPES, shape=(t,))
    device = check_same_device(index_cache=index_cache, k=k, slot_mapping=slot_mapping)
    impl = resolve_backend(backend, device, "indexer_key_write", triton_dtypes_ok=k.dtype == torch.bfloat16, block_size=block_size)
    if impl == "torch":
        indexer_key_write_reference(index_cache, k, slot_mapping, block_size, hadamard)
        return
    if di < 2 or di & (di - 1):
        raise ValueError(f"k: the Triton kernel takes a power-of-two DI, got shape {list(k.shape)}")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache: the Triton kernel writes a contiguous cache in place; got strides "
                         f"{index_cache.stride()}")
    _indexer_key_write_triton(index_cache, k, slot_mapping, block_size, hadamard)
