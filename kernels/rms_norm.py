"""rms_norm: ``weight * (x / rms(x))`` normalized in fp32 and rounded to ``x``'s dtype before the weight
(the RMSNorm of DeepSeek-V3 and of HF's models), one kernel a call.

The reference is the model's four ops: ``x.float()``, ``F.rms_norm``, the cast back, the weight's multiply;
on CUDA that is four launches a norm, and a decode step at batch 1 is bound by its launch count (issue
#39: a DeepSeek-V3.2 layer runs four norms). The kernel reads each row once and writes it once, with the
same arithmetic in the same order but one: its sum of squares is its own reduction, so the mean, and so
the rounded row, may differ from the reference's in the last place, and the weight's product by up to two
(tests: at most two bf16 ulps, rarely: 5 of 58.7M values at D = 7168 on the H200).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_real, check_same_device, check_tensor, resolve_backend


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype), x
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_out, eps, D: tl.constexpr,
                     BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    """One program per row: (with ``RESIDUAL``, the row plus its residual rounded to bf16 and stored first)
    its mean square in fp32, the row times its rsqrt rounded to bf16, then the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=keep, other=0.0).to(tl.float32))
        x = x.to(tl.bfloat16)
        tl.store(sum_ptr + row * stride_out + cols, x, mask=keep)
    x = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * r).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(tl.bfloat16), mask=keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             backend: str = "auto"):
    """RMSNorm of the rows of ``x`` (of ``x + residual`` when given: the pre-norm block's residual add fused).

    Args:
        x: ``[..., D]`` bfloat16 (float32 and float64 through the reference), any strides.
        weight: ``[D]``, the dtype of ``x`` (the reference also takes others: torch's type promotion).
        eps: added to the mean square, a finite number.
        residual: None, or ``x``'s shape and dtype: the row normalized is ``x + residual`` rounded to the
            dtype (torch's add).

    Returns:
        ``[..., D]`` ``weight * (x * rsqrt(mean(x^2) + eps))``, the normalized row computed in fp32 and
        rounded to ``x``'s dtype before the multiply (a bf16 product rounded once), a new contiguous
        tensor; with ``residual``, ``(normed, x + residual)``, the sum bit for bit torch's.
        As the reference: a row holding NaN comes out NaN, one holding +-inf NaN there and zeros elsewhere
        (its rsqrt is 0), a zero row zeros; empty ``x`` gives empty.
        ``"auto"`` runs the kernel on CUDA bf16 rows when autograd is not recording (it has no
        backward), the reference otherwise.
    """
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim [..., D], got a 0-dim tensor")
    d = x.shape[-1]
    check_tensor("weight", weight, dtype=FLOAT_DTYPES, shape=(d,))
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype, shape=tuple(x.shape))
    eps = check_real("eps", eps)
    device = check_same_device(x=x, weight=weight, residual=residual)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual))
    impl = resolve_backend(backend, device, "rms_norm",
                           triton_dtypes_ok=x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16)
    if impl == "torch" or (backend == "auto" and recording):
        return rms_norm_reference(x, weight, eps, residual)
    rows, res = _rows(x, d), None if residual is None else _rows(residual, d)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    total = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=device)
    if rows.shape[0] and d:
        w = weight if weight.stride(0) == 1 else weight.contiguous()
        block = triton.next_power_of_2(d)
        # one variant per row width (D and the row strides are the model's); the row count is the grid
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if res is None else res, w, out, out if total is None else total,
                                           rows.stride(0), 0 if res is None else res.stride(0), d, eps, D=d,
                                           BLOCK=block, RESIDUAL=res is not None, num_warps=8 if block >= 4096 else 4)
    return out if residual is None else (out, total)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` as ``[rows, D]`` with a unit last stride: a strided 2-D view as it is, else a reshape."""
    rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()
