"""silu_mul: SwiGLU's ``silu(gate) * up``, one kernel a call.

The reference is torch's two ops (``F.silu``, then the multiply), each rounding to the inputs' dtype; the
kernel rounds at the same two places, so it differs from them only where its ``exp`` does in the last place
(tests: at most two bf16 ulps, rarely). One launch where torch takes two (issue #39: a decode step at batch 1
is bound by its launch count).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_same_device, check_tensor, resolve_backend

BLOCK = 1024  # elements a program


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, cols, stride_g, stride_u, BLOCK: tl.constexpr):
    """Program ``(r, j)``: columns ``j * BLOCK ..`` of row ``r``: ``silu(g)`` in fp32 rounded to bf16, times ``u``."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = c < cols
    g = tl.load(g_ptr + r * stride_g + c, mask=keep, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
    u = tl.load(u_ptr + r * stride_u + c, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * cols + c, (s * u).to(tl.bfloat16), mask=keep)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU's product), each op rounded to the dtype as torch does.

    Args:
        gate, up: ``[..., I]`` bfloat16 (float32 and float64 through the reference), one shape and dtype.

    Returns:
        ``[..., I]`` a new contiguous tensor of their dtype. ``"auto"`` runs the kernel on CUDA bf16 rows
        whose last stride is 1 when autograd is not recording, torch's two ops otherwise.
    """
    check_tensor("gate", gate, dtype=FLOAT_DTYPES)
    check_tensor("up", up, dtype=gate.dtype, shape=tuple(gate.shape))
    if gate.dim() == 0:
        raise ValueError("gate: expected at least 1 dim [..., I], got a 0-dim tensor")
    device = check_same_device(gate=gate, up=up)
    recording = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    impl = resolve_backend(backend, device, "silu_mul", triton_dtypes_ok=gate.dtype == torch.bfloat16)
    if impl == "torch" or (backend == "auto" and recording):
        return silu_mul_reference(gate, up)
    cols = gate.shape[-1]
    g, u = (t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(-1, cols) for t in (gate, up))
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=device)
    if g.shape[0] and cols:
        # one variant per width (I and the row strides are the model's); rows and column blocks are the grid
        _silu_mul_kernel[(g.shape[0], triton.cdiv(cols, BLOCK))](g, u, out, cols, g.stride(0), u.stride(0),
                                                                  BLOCK=BLOCK, num_warps=4)
    return out
