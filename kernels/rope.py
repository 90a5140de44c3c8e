"""YaRN cos/sin tables and rotary embedding (interleaved or NeoX): torch ops, and one Triton kernel for
:func:`rope_rotate` of bf16 rows on CUDA (one launch a call, in place where asked, where the torch ops take
four or five: a decode step at batch 1 is bound by its launch count, issue #39).

A position outside the table (negative, or ``>= cos.shape[0]``) reads no table row: its row comes
back unrotated (``x`` as it is), on every device, without a host sync.
"""
import math

import torch
import triton
import triton.language as tl

from .common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
    compute_dtype,
    resolve_backend,
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


def rope_at_reference(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pos = positions.long()
    inside = ((pos >= 0) & (pos < cos.shape[0]))[:, None]  # [T, 1]
    if cos.shape[0] == 0:
        return torch.ones(pos.shape[0], cos.shape[1], dtype=torch.complex128 if compute_dtype(cos, sin) ==
                          torch.float64 else torch.complex64, device=cos.device)
    row = torch.where(inside[:, 0], pos, 0)
    dt = compute_dtype(cos, sin)
    return torch.complex(torch.where(inside, cos[row].to(dt), 1.0), torch.where(inside, sin[row].to(dt), 0.0))


@triton.jit(do_not_specialize=["num_positions"], do_not_specialize_on_alignment=["pos_ptr"])
def _rope_at_kernel(pos_ptr, cos_ptr, sin_ptr, out_ptr, num_positions, HALF: tl.constexpr):
    """Program ``t``: the table row at ``positions[t]`` as ``(cos, sin)`` pairs, ``(1, 0)`` outside the table."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    inside = (pos >= 0) & (pos < num_positions)
    row = tl.where(inside, pos, 0)
    c = tl.where(inside, tl.load(cos_ptr + row * HALF + i), 1.0)
    s = tl.where(inside, tl.load(sin_ptr + row * HALF + i), 0.0)
    tl.store(out_ptr + t * (2 * HALF) + 2 * i, c)
    tl.store(out_ptr + t * (2 * HALF) + 2 * i + 1, s)


def rope_at(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Per-token rotations ``cos + i sin`` at ``positions [T]`` (int32/int64): ``[T, D_R / 2]`` complex64
    (complex128 for float64 tables). The same for every layer of a step: a model computes it once per step.
    A position outside ``[0, len(cos))`` reads nothing and gets the identity rotation (no host sync).
    ``"auto"`` gathers the rows in one Triton launch on CUDA with contiguous float32 tables (the same
    values: a gather), the torch ops otherwise."""
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=1)
    check_tensor("cos", cos, dtype=FLOAT_DTYPES, shape=2)
    check_tensor("sin", sin, dtype=cos.dtype, shape=tuple(cos.shape))
    device = check_same_device(positions=positions, cos=cos, sin=sin)
    fits = cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] > 0
    if resolve_backend(backend, device, "rope_at", triton_dtypes_ok=fits) == "torch":
        return rope_at_reference(positions, cos, sin)
    half = cos.shape[1]
    out = torch.empty(positions.shape[0], half, 2, dtype=torch.float32, device=device)
    if positions.shape[0]:
        _rope_at_kernel[(positions.shape[0],)](positions, cos, sin, out, cos.shape[0], HALF=half, num_warps=1)
    return torch.view_as_complex(out)


def rope_rotate_reference(x: torch.Tensor, rot: torch.Tensor, interleaved: bool) -> torch.Tensor:
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


@triton.jit
def _rope_rotate_kernel(x_ptr, rot_ptr, out_ptr, heads, stride_xt, stride_xh, stride_ot, stride_oh,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Program ``(t, j)``: heads ``j * BLOCK_H ..`` of token ``t``, each pair ``(a, b)`` times ``rot[t, i]``
    in fp32 as the complex product ``(a c - b s, a s + b c)``; a program loads its pairs before it stores
    them, so ``out`` may be ``x``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    keep = (h < heads)[:, None]
    c = tl.load(rot_ptr + t * (2 * HALF) + 2 * i)[None, :]
    s = tl.load(rot_ptr + t * (2 * HALF) + 2 * i + 1)[None, :]
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + HALF
    src = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    a = tl.load(src + ia[None, :], mask=keep).to(tl.float32)
    b = tl.load(src + ib[None, :], mask=keep).to(tl.float32)
    dst = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh
    tl.store(dst + ia[None, :], (a * c - b * s).to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(dst + ib[None, :], (a * s + b * c).to(out_ptr.dtype.element_ty), mask=keep)


def rope_rotate(x: torch.Tensor, rot: torch.Tensor, interleaved: bool, *, out: torch.Tensor | None = None,
                backend: str = "auto") -> torch.Tensor:
    """Rotate the last dim of ``x [T, ..., D_R]`` by ``rot [T, D_R / 2]`` (from :func:`rope_at`).

    Pair ``i`` is ``(x[2i], x[2i+1])`` (interleaved) or ``(x[i], x[i + D_R/2])`` (NeoX); read as
    the complex number ``a + i b`` it becomes ``(a + i b) * rot[i]``, i.e.
    ``(a cos - b sin, b cos + a sin)``. Computed in float32 (float64 for float64 ``x``), returned
    in ``x``'s dtype: a new tensor, or written into ``out`` (``x``'s shape and dtype, any strides; it may
    be ``x`` itself: a rotation in place) and returned.

    ``"auto"`` runs the Triton kernel on CUDA bf16 ``x`` with complex64 ``rot`` (the model's) unless
    autograd is recording, the torch ops otherwise; the kernel's products may round differently from
    torch's in the last place (fused multiply-adds).
    """
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [T, ..., D_R] with D_R even, got {list(x.shape)}")
    check_tensor("rot", rot, dtype=(torch.complex64, torch.complex128), shape=(x.shape[0], x.shape[-1] // 2))
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, shape=tuple(x.shape))
    device = check_same_device(x=x, rot=rot, out=out)
    recording = torch.is_grad_enabled() and x.requires_grad
    fits = x.dtype == torch.bfloat16 and rot.dtype == torch.complex64
    impl = resolve_backend(backend, device, "rope_rotate", triton_dtypes_ok=fits)
    if impl == "torch" or (backend == "auto" and recording):
        y = rope_rotate_reference(x, rot, interleaved)
        return y if out is None else out.copy_(y)
    t, d = x.shape[0], x.shape[-1]
    x3 = _as_rows(x)
    x3 = x.reshape(t, -1, d).contiguous() if x3 is None else x3  # [T, heads, D_R], a unit last stride
    o3 = None if out is None else _as_rows(out)
    dst = torch.empty(x3.shape, dtype=x.dtype, device=device) if o3 is None else o3
    if x.numel():
        heads = x3.shape[1]
        block_h = min(triton.next_power_of_2(heads), 32)
        table = torch.view_as_real(rot if rot.is_contiguous() else rot.contiguous())  # [T, D_R / 2, 2] fp32
        # one variant per (D_R, heads block, layout, strides): the model's; T and the heads are the grid
        _rope_rotate_kernel[(t, triton.cdiv(heads, block_h))](
            x3, table, dst, heads, x3.stride(0), x3.stride(1), dst.stride(0), dst.stride(1), HALF=d // 2,
            BLOCK_H=block_h, INTERLEAVED=bool(interleaved), num_warps=4)
    if out is None:
        return dst.view(x.shape)
    if o3 is None:
        out.copy_(dst.view(x.shape))
    return out


def _as_rows(v: torch.Tensor) -> torch.Tensor | None:
    """A ``[T, heads, D_R]`` view of ``v`` with a unit last stride, or None where there is none."""
    if v.dim() == 2:
        v = v[:, None]
    elif v.dim() > 3:
        try:
            v = v.view(v.shape[0], -1, v.shape[-1])
        except RuntimeError:
            return None
    return v if v.stride(-1) == 1 else None


def apply_rope_reference(x, positions, cos, sin, interleaved):
    return rope_rotate_reference(x, rope_at_reference(positions, cos, sin), interleaved)


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
