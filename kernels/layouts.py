"""Byte layouts of the paged caches and the ue8m0 scale rule, in one place.

Every reader and writer (torch references and Triton kernels) takes its offsets from here.

Indexer key cache, one per layer that runs an indexer: ``uint8 [num_blocks, P * 132]``,
planar inside each block (byte-compatible with DeepGEMM, vLLM and SGLang)::

    block b:  | k8[0] k8[1] ... k8[P-1]           | s[0] s[1] ... s[P-1] |
              | P * 128 bytes of float8_e4m3fn    | P * 4 bytes of fp32  |
    token t of the block: values at bytes [t*128, t*128 + 128), scale at P*128 + 4*t

A ``[num_blocks, P, 132]`` view does NOT give token t's record: its row t mixes the
values of tokens. Use :func:`indexer_cache_views`.

Latent cache, one per layer, shared by all heads (``kv_cache_format``):

- ``"bf16"``: ``bfloat16 [num_blocks, P, 576]``, row = ``[kv_c (512) | k_pe (64)]``.
- ``"fp8"`` (FlashMLA layout, token-major, 656 bytes a row)::

      bytes [0, 512)    512 float8_e4m3fn of kv_c, four 128-wide tiles
      bytes [512, 528)  4 fp32 scales, one per tile (ue8m0 of max(amax / 448, 1e-4))
      bytes [528, 656)  64 bf16 of k_pe

- ``"fp32"``: ``float32 [num_blocks, P, 576]`` (references only).

ue8m0 scale: for an fp32 ratio ``r > 0``, the smallest power of two ``>= r``, computed
from the bits (exponent, plus one if any mantissa bit is set), never through ``log2``.
"""
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Indexer key cache
INDEXER_HEAD_DIM = 128  # DI
INDEXER_SCALE_BYTES = 4
INDEXER_BYTES_PER_TOKEN = INDEXER_HEAD_DIM + INDEXER_SCALE_BYTES  # 132
INDEXER_AMAX_FLOOR = 1e-4  # r = max(amax, 1e-4) / 448

# Latent cache
KV_LORA_RANK = 512  # R
ROPE_DIM = 64  # D_R
LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # D_L = 576
LATENT_FP8_TILE = 128
LATENT_FP8_TILES = KV_LORA_RANK // LATENT_FP8_TILE  # 4
LATENT_FP8_SCALE_OFFSET = KV_LORA_RANK  # 512
LATENT_FP8_ROPE_OFFSET = LATENT_FP8_SCALE_OFFSET + 4 * LATENT_FP8_TILES  # 528
LATENT_FP8_BYTES = LATENT_FP8_ROPE_OFFSET + 2 * ROPE_DIM  # 656
LATENT_FP8_RATIO_FLOOR = 1e-4  # r = max(amax / 448, 1e-4)


def ue8m0_ceil(r: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= r, for positive normal fp32 ``r``, exactly (from the bits)."""
    assert r.dtype == torch.float32
    bits = r.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def indexer_key_scale(amax: torch.Tensor) -> torch.Tensor:
    """Scale of an indexer key or query group: ue8m0 of ``max(amax, 1e-4) / 448`` (fp32)."""
    return ue8m0_ceil(amax.float().clamp_min(INDEXER_AMAX_FLOOR) / FP8_MAX)


def latent_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Scale of a 128-wide kv_c tile in the 656-byte cache: ue8m0 of ``max(amax / 448, 1e-4)``."""
    return ue8m0_ceil((amax.float() / FP8_MAX).clamp_min(LATENT_FP8_RATIO_FLOOR))


def indexer_cache_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a planar indexer cache ``uint8 [NB, P * (DI + 4)]``.

    Returns ``(k8 [NB, P, DI] float8_e4m3fn, scale [NB, P] float32)``, sharing its storage.
    """
    nb, row = cache.shape
    di = row // block_size - INDEXER_SCALE_BYTES
    k8 = cache[:, : block_size * di].view(nb, block_size, di).view(torch.float8_e4m3fn)
    scale = cache[:, block_size * di:].view(torch.float32)
    return k8, scale


def latent_fp8_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a 656-byte latent cache ``uint8 [NB, P, 656]``.

    Returns ``(kv8 [NB, P, 512] float8_e4m3fn, scale [NB, P, 4] float32, k_pe [NB, P, 64] bfloat16)``.
    """
    kv8 = cache[..., :LATENT_FP8_SCALE_OFFSET].view(torch.float8_e4m3fn)
    scale = cache[..., LATENT_FP8_SCALE_OFFSET:LATENT_FP8_ROPE_OFFSET].view(torch.float32)
    k_pe = cache[..., LATENT_FP8_ROPE_OFFSET:].view(torch.bfloat16)
    return kv8, scale, k_pe


def latent_cache_format(cache: torch.Tensor) -> str:
    """``"bf16"``, ``"fp8"`` or ``"fp32"`` from a latent cache tensor's dtype and width."""
    if cache.dim() == 3 and cache.dtype == torch.bfloat16 and cache.shape[-1] == LATENT_DIM:
        return "bf16"
    if cache.dim() == 3 and cache.dtype == torch.uint8 and cache.shape[-1] == LATENT_FP8_BYTES:
        return "fp8"
    if cache.dim() == 3 and cache.dtype == torch.float32 and cache.shape[-1] == LATENT_DIM:
        return "fp32"
    raise ValueError(
        "latent_cache: expected bfloat16 [NB, P, 576], uint8 [NB, P, 656] or float32 [NB, P, 576], "
        f"got {cache.dtype} {list(cache.shape)}")
