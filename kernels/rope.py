"""Torch-only ops: YaRN cos/sin tables and rotary embedding (interleaved or NeoX).

A position outside the table (negative, or ``>= cos.shape[0]``) reads no table row: its row comes
back unrotated (``x`` as it is), on every device, without a host sync.
"""
import math

import torch

from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
    compute_dtype,
    torch_only,
)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude: ``0.1 * mscale * ln(factor) + 1`` for ``factor > 1``, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(rope_dim: int, base: float, scaling: dict) -> torch.Tensor:
    factor = check_real("rope_scaling['factor']", scaling.get("factor"), positive=True)
    original = check_int("rope_scaling['original_max_position_embeddings']",
                         scaling.get("original_max_position_embeddings"), minimum=1)
    beta_fast = check_real("rope_scaling['beta_fast']", scaling.get("beta_fast", 32), positive=True)
    beta_slow = check_real("rope_scaling['beta_slow']", scaling.get("beta_slow", 1), positive=True)
    if base == 1.0:
        raise ValueError("rope_theta: YaRN divides by ln(rope_theta); expected a value other than 1, got 1")

    def correction_dim(rotations):
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where a dim keeps its original frequency
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def yarn_cos_sin(max_positions: int, rope_dim: int, rope_theta: float, rope_scaling: dict | None = None,
                 *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables, with DeepSeek YaRN when ``rope_scaling`` says ``yarn``.

    Args:
        max_positions: rows of the tables (positions 0 .. max_positions - 1), an int >= 1.
        rope_dim: ``D_R`` (an even int >= 2).
        rope_theta: the base, a finite number > 0 (not 1 under YaRN).
        rope_scaling: ``None`` or a dict with ``type``/``rope_type`` ``"yarn"``, ``factor``,
            ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
            ``mscale_all_dim`` (HF names); ``factor``, ``beta_fast`` and ``beta_slow`` finite and
            > 0, ``original_max_position_embeddings`` an int >= 1.

    Returns:
        ``(cos, sin)``, each ``[max_positions, rope_dim // 2]`` float32, multiplied by
        ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` under YaRN.
    """
    torch_only(backend, "yarn_cos_sin")
    if check_int("rope_dim", rope_dim, minimum=2) % 2:
        raise ValueError(f"rope_dim: expected an even int, got {rope_dim!r}")
    max_positions = check_int("max_positions", max_positions, minimum=1)
    rope_theta = check_real("rope_theta", rope_theta, positive=True)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling: expected None or a dict, got {type(rope_scaling).__name__}")
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    attention_factor = 1.0
    if kind == "yarn":
        inv_freq = _yarn_inv_freq(rope_dim, rope_theta, rope_scaling)
        factor = float(rope_scaling["factor"])
        attention_factor = (yarn_mscale(factor, check_real("rope_scaling['mscale']", rope_scaling.get("mscale", 1.0)))
                            / yarn_mscale(factor, check_real("rope_scaling['mscale_all_dim']",
                                                             rope_scaling.get("mscale_all_dim", 0.0))))
    elif kind == "default":
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    else:
        raise ValueError(f"rope_scaling: only 'yarn' or no scaling is supported, got {kind!r}")
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D_R/2]
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_at(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-token rotations ``cos + i sin`` at ``positions [T]``: ``[T, D_R / 2]`` complex64 (complex128
    for float64 tables). The same for every layer of a step: a model computes it once per step.
    A position outside ``[0, len(cos))`` reads nothing and gets the identity rotation (no host sync)."""
    pos = positions.long()
    inside = ((pos >= 0) & (pos < cos.shape[0]))[:, None]  # [T, 1]
    if cos.shape[0] == 0:
        return torch.ones(pos.shape[0], cos.shape[1], dtype=torch.complex128 if compute_dtype(cos, sin) ==
                          torch.float64 else torch.complex64, device=cos.device)
    row = torch.where(inside[:, 0], pos, 0)
    dt = compute_dtype(cos, sin)
    return torch.complex(torch.where(inside, cos[row].to(dt), 1.0), torch.where(inside, sin[row].to(dt), 0.0))


def rope_rotate(x: torch.Tensor, rot: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x [T, ..., D_R]`` by ``rot [T, D_R / 2]`` (from :func:`rope_at`).

    Pair ``i`` is ``(x[2i], x[2i+1])`` (interleaved) or ``(x[i], x[i + D_R/2])`` (NeoX); read as
    the complex number ``a + i b`` it becomes ``(a + i b) * rot[i]``, i.e.
    ``(a cos - b sin, b cos + a sin)``. Computed in float32 (float64 for float64 ``x``), returned
    in ``x``'s dtype.
    """
    dt = compute_dtype(x)
    rot = rot.to(torch.complex128 if dt == torch.float64 else torch.complex64)
    rot = rot.view((x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,))
    xf = x.to(dt)
    if interleaved:
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2)).contiguous()) * rot).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        z = torch.complex(a, b) * rot
        out = torch.cat((z.real, z.imag), dim=-1)
    return out.to(x.dtype)


def apply_rope_reference(x, positions, cos, sin, interleaved):
    return rope_rotate(x, rope_at(positions, cos, sin), interleaved)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool, *, backend: str = "auto") -> torch.Tensor:
    """Rotate the whole last dim of ``x`` by each token's position.

    Args:
        x: ``[T, ..., D_R]`` bfloat16, float32 or float64.
        positions: ``[T]`` int32/int64; a row whose position is outside ``[0, cos.shape[0])`` reads
            no table row and gets the identity rotation (finite values come back as they are).
        cos, sin: ``[max_positions, D_R // 2]`` float32 (from :func:`yarn_cos_sin`).
        interleaved: rotate pairs ``(x[2i], x[2i+1])`` (MLA, DeepSeek layout) if True, else
            NeoX halves ``(x[i], x[i + D_R/2])``.

    Returns:
        The same shape and dtype (computed in float32, float64 for float64 input).
    """
    torch_only(backend, "apply_rope")
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [T, ..., D_R] with D_R even, got {list(x.shape)}")
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(x.shape[0],))
    check_tensor("cos", cos, dtype=FLOAT_DTYPES, shape=(None, x.shape[-1] // 2))
    check_tensor("sin", sin, dtype=FLOAT_DTYPES, shape=tuple(cos.shape))
    check_same_device(x=x, positions=positions, cos=cos, sin=sin)
    return apply_rope_reference(x, positions, cos, sin, interleaved)
