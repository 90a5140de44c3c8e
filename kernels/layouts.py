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

Non-finite input. e4m3fn has NaN but no inf, and a group's shared scale cannot encode a
non-finite amax, so a quantization group (an indexer key row, an indexer query (token, head)
row, a 128-wide kv_c tile of the FP8 latent row) holding any NaN or +-inf is stored as NaN:
every value byte ``0x7F`` (:data:`FP8_NAN_BYTE`) and the scale ``0x7FC00000``
(:data:`FP32_NAN_BITS`). Finite groups are unaffected. The fault stays visible downstream
(NaN logits, which the top-k ranks by their bits; NaN attention rows) instead of turning into
a plausible finite number, and every backend writes the same bytes. fp32 outputs derived from a
NaN (the query weights) are written as ``0x7FC00000`` as well; bf16 rows (``k_pe``, the bf16
latent cache) are copied bit for bit.

Bytes per token: :func:`indexer_bytes_per_token` and :func:`latent_bytes_per_token` are what the
caches allocate and what ``dsa.bytes_per_token`` adds up.
"""
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_NAN_BYTE = 0x7F  # float8_e4m3fn NaN: the values of a group holding NaN or +-inf
FP32_NAN_BITS = 0x7FC00000  # fp32 quiet NaN: the scale of such a group

# Indexer key cache
INDEXER_HEAD_DIM = 128  # DI
INDEXER_SCALE_BYTES = 4
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
LATENT_ROWS = {"bf16": (LATENT_DIM, torch.bfloat16), "fp8": (LATENT_FP8_BYTES, torch.uint8),
               "fp32": (LATENT_DIM, torch.float32)}  # format -> (row width, dtype) of [NB, P, width]


def indexer_bytes_per_token(head_dim: int = INDEXER_HEAD_DIM) -> int:
    """Bytes of one token in a planar FP8 indexer cache: ``head_dim`` e4m3 values and one fp32 scale
    (132 for DI = 128). The cache is ``uint8 [NB, P * indexer_bytes_per_token(DI)]``."""
    return head_dim + INDEXER_SCALE_BYTES


def latent_bytes_per_token(fmt: str) -> int:
    """Bytes of one latent row in format ``"bf16"`` (1152), ``"fp8"`` (656) or ``"fp32"`` (2304)."""
    width, dtype = LATENT_ROWS[fmt]
    return width * dtype.itemsize


def ue8m0_ceil(r: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= r, for positive normal fp32 ``r``, exactly (from the bits)."""
    assert r.dtype == torch.float32
    bits = r.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def encode_fp8_groups(groups: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups [..., G, g]`` (float) with their ue8m0 ``scale [..., G]`` fp32 ->
    ``(clamp(groups / scale, -448, 448) as e4m3 [..., G, g], scale)``, where a group holding NaN or
    +-inf becomes NaN: value bytes ``0x7F``, scale ``0x7FC00000`` (the non-finite rule above)."""
    bad = ~torch.isfinite(groups).all(dim=-1)  # [..., G]
    x8 = (groups / scale.to(groups.dtype).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    x8 = x8.view(torch.uint8).masked_fill(bad.unsqueeze(-1), FP8_NAN_BYTE).view(torch.float8_e4m3fn)
    scale = scale.view(torch.int32).masked_fill(bad, FP32_NAN_BITS).view(torch.float32)
    return x8, scale


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` with every NaN written as ``0x7FC00000`` (NaN payloads differ between devices)."""
    return x.view(torch.int32).masked_fill(torch.isnan(x), FP32_NAN_BITS).view(torch.float32)


def indexer_key_scale(amax: torch.Tensor) -> torch.Tensor:
    """Scale of an indexer key or query group: ue8m0 of ``max(amax, 1e-4) / 448`` (fp32)."""
    return ue8m0_ceil(amax.float().clamp_min(INDEXER_AMAX_FLOOR) / FP8_MAX)


def latent_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Scale of a 128-wide kv_c tile in the 656-byte cache: ue8m0 of ``max(amax / 448, 1e-4)``."""
    return ue8m0_ceil((amax.float() / FP8_MAX).clamp_min(LATENT_FP8_RATIO_FLOOR))


def indexer_cache_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a planar indexer cache ``uint8 [NB, P * indexer_bytes_per_token(DI)]``.

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
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"latent_cache: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() == 3 and cache.dtype == torch.bfloat16 and cache.shape[-1] == LATENT_DIM:
        return "bf16"
    if cache.dim() == 3 and cache.dtype == torch.uint8 and cache.shape[-1] == LATENT_FP8_BYTES:
        return "fp8"
    if cache.dim() == 3 and cache.dtype == torch.float32 and cache.shape[-1] == LATENT_DIM:
        return "fp32"
    raise ValueError(
        "latent_cache: expected bfloat16 [NB, P, 576], uint8 [NB, P, 656] or float32 [NB, P, 576], "
        f"got {cache.dtype} {list(cache.shape)}")
