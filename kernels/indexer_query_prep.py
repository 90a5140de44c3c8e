"""indexer_query_prep: Hadamard (optional), per-(token, head) ue8m0 FP8 queries, folded head weights.

A (token, head) row holding NaN or +-inf is NaN and NaN weights are ``0x7FC00000`` (the rule of
``layouts``): both backends give the same bytes whatever the inputs hold.
"""
import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_same_device, check_tensor, resolve_backend
from .indexer_key_write import hadamard_rows, nan_to_canonical, ue8m0_quant_rows
from .layouts import canonical_nan
from .quant import hadamard_reference, quant_ue8m0_reference


def weight_scale(heads: int, head_dim: int) -> float:
    """The constant folded into the head weights: ``HI**-0.5 * DI**-0.5`` (one fp32 multiply)."""
    return heads ** -0.5 * head_dim ** -0.5


def indexer_query_prep_reference(q, w, hadamard):
    t, hi, di = q.shape
    if t * hi == 0:
        return torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device), w.new_empty((t, hi))
    if hadamard:
        q = hadamard_reference(q)
    q8, q_scale = quant_ue8m0_reference(q, group=di)  # [T, HI, DI] e4m3, [T, HI, 1] fp32
    weights = w.float() * weight_scale(hi, di) * q_scale[..., 0]  # [T, HI] fp32
    return q8, canonical_nan(weights)


@triton.jit(do_not_specialize=["num_rows"])
def _indexer_query_prep_kernel(q_ptr, w_ptr, q8_ptr, out_w_ptr, num_rows, folded, hadamard_scale,
                               D: tl.constexpr, LOG2_D: tl.constexpr, BLOCK_R: tl.constexpr,
                               HADAMARD: tl.constexpr):
    # one program: BLOCK_R (token, head) rows of the contiguous q [T * HI, D] and w [T * HI]
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] int64
    cols = tl.arange(0, D)
    in_range = rows < num_rows
    x = tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=in_range[:, None], other=0.0)
    x = x.to(tl.float32)  # [BLOCK_R, D]
    if HADAMARD:
        x = hadamard_rows(x, BLOCK_R, D, LOG2_D)
        x = (x * hadamard_scale).to(tl.bfloat16).to(tl.float32)  # one multiply, rounded to q's dtype
    q8, scale = ue8m0_quant_rows(x)  # [BLOCK_R, D] e4m3, [BLOCK_R] fp32
    tl.store(q8_ptr + rows[:, None] * D + cols[None, :], q8, mask=in_range[:, None])
    w = tl.load(w_ptr + rows, mask=in_range, other=0.0)  # [BLOCK_R] fp32
    tl.store(out_w_ptr + rows, nan_to_canonical(w * folded * scale), mask=in_range)  # the reference's order


def _indexer_query_prep_triton(q, w, hadamard):
    t, hi, di = q.shape
    q = q.contiguous()
    w = w.contiguous()
    q8 = torch.empty((t, hi, di), dtype=torch.float8_e4m3fn, device=q.device)
    weights = torch.empty((t, hi), dtype=torch.float32, device=q.device)
    rows = t * hi
    if rows == 0:
        return q8, weights
    block_r = 16
    # one variant per (DI, HADAMARD): num_rows = T * HI changes per step (a runtime value); the scales are floats
    _indexer_query_prep_kernel[(triton.cdiv(rows, block_r),)](
        q, w, q8.view(torch.uint8), weights, rows, weight_scale(hi, di), di ** -0.5, D=di, LOG2_D=di.bit_length() - 1,
        BLOCK_R=block_r, HADAMARD=bool(hadamard), num_warps=4)
    return q8, weights


def indexer_query_prep(q: torch.Tensor, w: torch.Tensor, hadamard: bool, *,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 indexer queries and the weights that fold in their scales.

    Args:
        q: ``[T, HI, DI]`` bfloat16 (float32/float64 through the reference), after RoPE; ``DI`` a
            power of two for the Triton kernel.
        w: ``[T, HI]`` float32, the ``weights_proj`` output.
        hadamard: apply the ``DI``-point Hadamard transform (rounded to ``q``'s dtype) first.

    Returns:
        ``(q8 [T, HI, DI] float8_e4m3fn, weights [T, HI] float32)`` with one ue8m0 scale
        ``s`` per (token, head), ``q8 = clamp(q / s, -448, 448)`` and
        ``weights = w * (HI**-0.5 * DI**-0.5) * s``. A (token, head) row holding NaN or +-inf is
        NaN (bytes ``0x7F``, ``s`` = NaN), and every NaN weight is written as ``0x7FC00000``
        (``dsa.kernels.layouts``). The Triton kernel (one launch, 16 rows a program) gives the
        same bytes as the reference, whatever ``q`` and ``w`` hold. T = 0 gives empty outputs.
    """
    check_tensor("q", q, dtype=FLOAT_DTYPES, shape=3)
    t, hi, di = q.shape
    if di < 1 or (hadamard and di & (di - 1)):
        raise ValueError(f"q: expected DI >= 1 (a power of two with hadamard), got shape {list(q.shape)}")
    check_tensor("w", w, dtype=torch.float32, shape=(t, hi))
    device = check_same_device(q=q, w=w)
    impl = resolve_backend(backend, device, "indexer_query_prep", triton_dtypes_ok=q.dtype == torch.bfloat16)
    if impl == "torch":
        return indexer_query_prep_reference(q, w, hadamard)
    if di < 2 or di & (di - 1):
        raise ValueError(f"q: the Triton kernel takes a power-of-two DI, got shape {list(q.shape)}")
    return _indexer_query_prep_triton(q, w, hadamard)
