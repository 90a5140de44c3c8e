"""indexer_query_prep: Hadamard (optional), per-(token, head) ue8m0 FP8 queries, folded head weights."""
import torch

from .common import FLOAT_DTYPES, check_same_device, check_tensor, resolve_backend
from .quant import hadamard_reference, quant_ue8m0_reference


def weight_scale(heads: int, head_dim: int) -> float:
    """The constant folded into the head weights: ``HI**-0.5 * DI**-0.5`` (one fp32 multiply)."""
    return heads ** -0.5 * head_dim ** -0.5


def indexer_query_prep_reference(q, w, hadamard):
    t, hi, di = q.shape
    if hadamard:
        q = hadamard_reference(q)
    q8, q_scale = quant_ue8m0_reference(q, group=di)  # [T, HI, DI] e4m3, [T, HI, 1] fp32
    weights = w.float() * weight_scale(hi, di) * q_scale[..., 0]  # [T, HI] fp32
    return q8, weights


def indexer_query_prep(q: torch.Tensor, w: torch.Tensor, hadamard: bool, *,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 indexer queries and the weights that fold in their scales.

    Args:
        q: ``[T, HI, DI]`` bfloat16 (float32/float64 through the reference), after RoPE.
        w: ``[T, HI]`` float32, the ``weights_proj`` output.
        hadamard: apply the ``DI``-point Hadamard transform (rounded to ``q``'s dtype) first.

    Returns:
        ``(q8 [T, HI, DI] float8_e4m3fn, weights [T, HI] float32)`` with one ue8m0 scale
        ``s`` per (token, head), ``q8 = clamp(q / s, -448, 448)`` and
        ``weights = w * (HI**-0.5 * DI**-0.5) * s``.
    """
    check_tensor("q", q, dtype=FLOAT_DTYPES, shape=3)
    t, hi, di = q.shape
    check_tensor("w", w, dtype=torch.float32, shape=(t, hi))
    device = check_same_device(q=q, w=w)
    impl = resolve_backend(backend, device, "indexer_query_prep", kernel_ready=False, issue=3,
                           triton_dtypes_ok=q.dtype == torch.bfloat16)
    if impl == "torch":
        return indexer_query_prep_reference(q, w, hadamard)
