"""Torch-only ops: ue8m0 FP8 quantization and the Sylvester-order Hadamard transform.

No Triton versions: the Triton kernels that need these (key write, query prep) fuse the
same arithmetic, in the same order, and are tested byte-for-byte against these.
"""
import torch

from .common import FLOAT_DTYPES, check_int, check_tensor, compute_dtype, torch_only
from .layouts import encode_fp8_groups, indexer_key_scale


def quant_ue8m0_reference(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(compute_dtype(x)).unflatten(-1, (-1, group))  # [..., G, group]
    scale = indexer_key_scale(xf.abs().amax(dim=-1))  # [..., G] fp32, power of two
    x8, scale = encode_fp8_groups(xf, scale)  # groups holding NaN/inf become NaN
    return x8.flatten(-2), scale


def quant_ue8m0(x: torch.Tensor, group: int = 128, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group FP8 quantization with power-of-two (ue8m0) scales.

    Args:
        x: ``[..., D]`` bfloat16, float32 or float64; ``D`` a multiple of ``group``.
        group: values sharing one scale (128 for indexer keys and queries).

    Returns:
        ``(x8 [..., D] float8_e4m3fn, scale [..., D // group] float32)`` with
        ``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` computed from the bits and
        ``x8 = clamp(x / scale, -448, 448)``; ``x ~= x8 * scale``. A group holding NaN or
        +-inf is stored as NaN: value bytes ``0x7F`` and scale ``0x7FC00000``
        (``dsa.kernels.layouts``).
    """
    torch_only(backend, "quant_ue8m0")
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    group = check_int("group", group, minimum=1)
    if x.dim() == 0 or x.shape[-1] % group != 0:
        raise ValueError(f"group: expected a positive int dividing the last dim of x {list(x.shape)}, got {group!r}")
    return quant_ue8m0_reference(x, group)


def hadamard_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    y = x.to(compute_dtype(x))
    h = 1
    while h < d:  # butterfly stages in a fixed order, so kernels can match bit for bit
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * d ** -0.5).to(x.dtype)


def hadamard(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x @ H_D * D**-0.5`` with ``H_D`` the Sylvester-order Hadamard matrix.

    Args:
        x: ``[..., D]`` bfloat16, float32 or float64, ``D`` a power of two.

    Returns:
        The same shape and dtype. Computed in float32 (float64 for float64 input) as
        ``log2(D)`` butterfly stages with strides 1, 2, 4, ..., then one multiply by
        ``D**-0.5``, rounded once to ``x.dtype``.
    """
    torch_only(backend, "hadamard")
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    d = x.shape[-1] if x.dim() else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: expected the last dim to be a power of two, got shape {list(x.shape)}")
    return hadamard_reference(x)
