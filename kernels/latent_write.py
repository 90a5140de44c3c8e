"""latent_write: store ``[kv_c | k_pe]`` rows in the latent cache (bf16, FP8-656 or fp32) by slot.

A slot outside ``[0, NB * P)`` writes nothing, on every backend, without a host sync.
"""
import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, resolve_backend
from .layouts import (
    FP8_MAX,
    FP8_NAN_BYTE,
    FP32_NAN_BITS,
    KV_LORA_RANK,
    LATENT_FP8_RATIO_FLOOR,
    LATENT_FP8_ROPE_OFFSET,
    LATENT_FP8_SCALE_OFFSET,
    LATENT_FP8_TILE,
    ROPE_DIM,
    encode_fp8_groups,
    latent_cache_format,
    latent_fp8_scale,
    latent_fp8_views,
)


def latent_write_reference(latent_cache, kv_c, k_pe, slot_mapping):
    block_size = latent_cache.shape[1]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < latent_cache.shape[0] * block_size)  # slots outside the cache: skipped
    block, offset = slots[keep] // block_size, slots[keep] % block_size
    kv_c, k_pe = kv_c[keep], k_pe[keep]
    if latent_cache_format(latent_cache) != "fp8":
        latent_cache[block, offset] = torch.cat((kv_c, k_pe), dim=-1).to(latent_cache.dtype)
        return
    tiles = kv_c.float().unflatten(-1, (-1, LATENT_FP8_TILE))  # [T, 4, 128]
    scale = latent_fp8_scale(tiles.abs().amax(dim=-1))  # [T, 4] fp32, power of two
    kv8, scale = encode_fp8_groups(tiles, scale)  # tiles holding NaN/inf become NaN
    kv8_cache, scale_cache, k_pe_cache = latent_fp8_views(latent_cache)
    kv8_cache[block, offset] = kv8.flatten(-2)
    scale_cache[block, offset] = scale
    k_pe_cache[block, offset] = k_pe.to(torch.bfloat16)


_FP8_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(LATENT_FP8_RATIO_FLOOR)
_SCALE_OFF = tl.constexpr(LATENT_FP8_SCALE_OFFSET)
_ROPE_OFF = tl.constexpr(LATENT_FP8_ROPE_OFFSET)
_NAN_BYTE = tl.constexpr(FP8_NAN_BYTE)
_NAN_BITS = tl.constexpr(FP32_NAN_BITS)


@triton.jit(do_not_specialize=["num_slots"], do_not_specialize_on_alignment=["slot_ptr"])
def _latent_write_kernel(cache_ptr, kv_ptr, pe_ptr, slot_ptr, stride_kv, stride_pe, stride_cb, stride_cp, block_size,
                         num_slots, FP8: tl.constexpr):
    """One program per token: its row ``[kv_c | k_pe]`` to slot ``slot_mapping[t]`` (skipped outside
    ``[0, num_slots)``)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        base = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cp
        d = tl.arange(0, 512)
        e = tl.arange(0, 64)
        pe = tl.load(pe_ptr + t * stride_pe + e)  # [64] bf16
        if FP8:
            x = tl.load(kv_ptr + t * stride_kv + tl.reshape(d, (4, 128))).to(tl.float32)  # [4, 128]
            # tiles holding NaN/inf are NaN (an integer reduction: float max treats NaN per backend)
            bad = tl.max((tl.abs(x) == float("inf")).to(tl.int32) | (x != x).to(tl.int32), 1) != 0  # [4]
            amax = tl.max(tl.abs(x), 1)  # [4]
            r = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FLOOR)
            bits = r.to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (exponent << 23).to(tl.float32, bitcast=True)  # [4] ue8m0, a power of two
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX), _FP8_MAX)
            y8 = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # round to nearest even
            y8 = tl.where(bad[:, None], _NAN_BYTE, y8).to(tl.uint8)
            scale = tl.where(bad, tl.full([4], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True), scale)
            tl.store(base + tl.reshape(d, (4, 128)), y8)
            tl.store((base + _SCALE_OFF).to(tl.pointer_type(tl.float32)) + tl.arange(0, 4), scale)
            tl.store((base + _ROPE_OFF).to(tl.pointer_type(tl.bfloat16)) + e, pe)
        else:
            tl.store(base + d, tl.load(kv_ptr + t * stride_kv + d))
            tl.store(base + 512 + e, pe)


def latent_write(latent_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                 *, backend: str = "auto") -> None:
    """Write latent rows into the paged cache, in place.

    Args:
        latent_cache: bfloat16 ``[NB, P, 576]``, uint8 ``[NB, P, 656]`` (FlashMLA FP8 layout)
            or float32 ``[NB, P, 576]`` (reference only).
        kv_c: ``[T, 512]`` bfloat16 (float32/float64 through the reference), after kv_a_layernorm.
        k_pe: ``[T, 64]``, same dtype, after RoPE.
        slot_mapping: ``[T]`` int32/int64; a slot outside ``[0, NB * P)`` (``-1``, any negative,
            ``NB * P`` or more) is skipped: nothing is written for that row.

    bf16/fp32 rows are ``[kv_c | k_pe]`` cast to the cache dtype. FP8 rows hold four 128-wide
    e4m3 tiles of ``kv_c`` with ue8m0 scales ``max(amax / 448, 1e-4)``, then ``k_pe`` in bf16; a
    tile holding NaN or +-inf is stored as NaN (bytes ``0x7F``, scale ``0x7FC00000``). The Triton
    kernel writes the same bytes as the reference, whatever the inputs hold. T = 0 writes nothing.
    """
    fmt = latent_cache_format(latent_cache)
    check_tensor("kv_c", kv_c, dtype=FLOAT_DTYPES, shape=(None, KV_LORA_RANK))
    t = kv_c.shape[0]
    check_tensor("k_pe", k_pe, dtype=kv_c.dtype, shape=(t, ROPE_DIM))
    check_tensor("slot_mapping", slot_mapping, dtype=INDEX_DTYPES, shape=(t,))
    device = check_same_device(latent_cache=latent_cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    impl = resolve_backend(backend, device, "latent_write", triton_dtypes_ok=fmt != "fp32" and kv_c.dtype == torch.bfloat16)
    if impl == "torch":
        latent_write_reference(latent_cache, kv_c, k_pe, slot_mapping)
        return
    if t == 0:
        return
    if latent_cache.stride(2) != 1 or kv_c.stride(1) != 1 or k_pe.stride(1) != 1:
        raise ValueError("latent_cache, kv_c, k_pe: expected unit stride along the last dim")
    # one variant per cache format: the strides of kv_c, k_pe and the cache and the block size specialize
    # (fixed by the model and the cache layout, multiples of 16 for the vectorized row copies); num_slots is
    # a runtime value and slot_mapping is not specialized on its alignment
    _latent_write_kernel[(t,)](latent_cache, kv_c, k_pe, slot_mapping, kv_c.stride(0), k_pe.stride(0),
                               latent_cache.stride(0), latent_cache.stride(1), latent_cache.shape[1],
                               latent_cache.shape[0] * latent_cache.shape[1], FP8=fmt == "fp8", num_warps=4)
