"""indexer_key_write: Hadamard (optional), ue8m0 FP8 quantization per token, planar store by slot."""
import torch

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_block_size, check_same_device, check_tensor, resolve_backend
from .layouts import INDEXER_SCALE_BYTES, indexer_cache_views
from .quant import hadamard_reference, quant_ue8m0_reference


def indexer_key_write_reference(index_cache, k, slot_mapping, block_size, hadamard):
    if hadamard:
        k = hadamard_reference(k)  # rounded to k's dtype, as the model stores it
    k8, scale = quant_ue8m0_reference(k, group=k.shape[-1])  # [T, DI] e4m3, [T, 1] fp32
    k8_cache, scale_cache = indexer_cache_views(index_cache, block_size)  # [NB, P, DI], [NB, P]
    slots = slot_mapping.long()
    keep = slots >= 0
    block, offset = slots[keep] // block_size, slots[keep] % block_size
    k8_cache[block, offset] = k8[keep]
    scale_cache[block, offset] = scale[keep, 0]


def indexer_key_write(index_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                      hadamard: bool, *, backend: str = "auto") -> None:
    """Quantize indexer keys and store them in the planar paged cache, in place.

    Args:
        index_cache: ``uint8 [NB, P * (DI + 4)]``, planar per block (``dsa.kernels.layouts``).
        k: ``[T, DI]`` bfloat16 (float32/float64 through the reference), after LayerNorm and RoPE.
        slot_mapping: ``[T]`` int32/int64 slots ``block * P + offset``; ``-1`` (any negative) is skipped.
        block_size: ``P``.
        hadamard: apply the ``DI``-point Hadamard transform (rounded to ``k``'s dtype) first.

    Each kept token gets ``DI`` e4m3 values ``clamp(k / s, -448, 448)`` at bytes
    ``[t * DI, (t + 1) * DI)`` of its block and ``s = ue8m0(max(amax, 1e-4) / 448)`` as fp32 at
    ``P * DI + 4 * t``.
    """
    check_tensor("k", k, dtype=FLOAT_DTYPES, shape=2)
    t, di = k.shape
    block_size = check_block_size(block_size)
    check_tensor("index_cache", index_cache, dtype=torch.uint8, shape=(None, block_size * (di + INDEXER_SCALE_BYTES)))
    check_tensor("slot_mapping", slot_mapping, dtype=INDEX_DTYPES, shape=(t,))
    device = check_same_device(index_cache=index_cache, k=k, slot_mapping=slot_mapping)
    impl = resolve_backend(backend, device, "indexer_key_write", kernel_ready=False, issue=3,
                           triton_dtypes_ok=k.dtype == torch.bfloat16, block_size=block_size)
    if impl == "torch":
        indexer_key_write_reference(index_cache, k, slot_mapping, block_size, hadamard)
