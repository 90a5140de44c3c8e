"""rms_norm: the Triton kernel (the interpreter here) against the reference at odd widths, strided rows,
non-finite rows and the model's module; the routing of ``"auto"``; the errors naming the argument."""
import pytest
import torch

from dsa.kernels import rms_norm, rms_norm_reference
from dsa.model.layers import RMSNorm

EPS = 1e-6


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """bf16 units in the last place between two bf16 tensors of finite values (their bit patterns as ordered ints)."""
    a, b = (t.view(torch.int16).to(torch.int32) for t in (got, want))
    a, b = (torch.where(t < 0, -32768 - t, t) for t in (a, b))  # sign-magnitude to a monotone order
    return (a - b).abs()


def _rows(t: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, t)[:, None]  # rows of very different magnitudes
    return (torch.randn(t, d, generator=g) * scale).to(torch.bfloat16)


def _check_close(got: torch.Tensor, want: torch.Tensor, most: int = 2) -> None:
    """Within ``most`` bf16 ulps, and rarely apart: the normalized row rounds to bf16 one ulp apart at most
    (its own sum of squares), and the weight's product, rounded again, can make that two (seen on the H200:
    5 of 58.7M values at D = 7168)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    ulps = _ulps(got, want)
    assert ulps.max() <= most, f"{int((ulps > most).sum())} of {ulps.numel()} values more than {most} bf16 ulps apart"
    assert (ulps > 0).float().mean() < 0.02, f"{int((ulps > 0).sum())} of {ulps.numel()} values differ"


@pytest.mark.parametrize("t,d", [(1, 16), (3, 384), (5, 512), (2, 1536), (7, 100), (1, 7168)],
                         ids=lambda v: str(v))
def test_kernel_matches_the_reference(t, d):
    x = _rows(t, d)
    w = (1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    _check_close(rms_norm(x, w, EPS, backend="triton"), rms_norm_reference(x, w, EPS))


def test_strided_rows_and_leading_dims():
    base = _rows(6, 576)
    x = base[:, :512]  # the latent's kv_c: rows of 512 with stride 576
    w = torch.ones(512, dtype=torch.bfloat16)
    got = rms_norm(x, w, EPS, backend="triton")
    _check_close(got, rms_norm_reference(x, w, EPS))
    assert got.is_contiguous()
    x3 = _rows(12, 64).view(3, 4, 64).transpose(0, 1)  # [4, 3, 64], not contiguous
    _check_close(rms_norm(x3, w[:64], EPS, backend="triton"), rms_norm_reference(x3, w[:64], EPS))


def test_non_finite_and_zero_rows():
    x = _rows(4, 384)
    x[0, 7] = float("nan")
    x[1, 3] = float("inf")
    x[2] = 0
    w = torch.ones(384, dtype=torch.bfloat16)
    got, want = rms_norm(x, w, EPS, backend="triton"), rms_norm_reference(x, w, EPS)
    assert got[0].isnan().all() and torch.equal(got[:2].isnan(), want[:2].isnan())  # inf: NaN there, zeros
    assert torch.equal(got[1].nan_to_num(), want[1].nan_to_num())  # elsewhere (its rsqrt is 0), as the reference
    assert torch.equal(got[2], torch.zeros(384, dtype=torch.bfloat16))
    _check_close(got[2:], want[2:])


def test_empty_rows():
    x = torch.zeros(0, 384, dtype=torch.bfloat16)
    out = rms_norm(x, torch.ones(384, dtype=torch.bfloat16), EPS, backend="triton")
    assert out.shape == (0, 384) and out.dtype == torch.bfloat16


def test_auto_runs_the_reference_off_cuda_and_for_float32():
    x = _rows(3, 64).float()
    w = torch.rand(64)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    with pytest.raises(TypeError, match="^rms_norm"):
        rms_norm(x, w, EPS, backend="triton")


def test_the_module_is_the_reference_off_cuda():
    m = RMSNorm(384, EPS).to(torch.bfloat16)
    x = _rows(5, 384)
    assert torch.equal(m(x), m.weight * torch.nn.functional.rms_norm(x.float(), (384,), eps=EPS).to(x.dtype))


def test_autograd_takes_the_reference():
    x = _rows(3, 32).float().requires_grad_(True)
    w = torch.ones(32, requires_grad=True)
    rms_norm(x, w, EPS).sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("call,exc,match", [
    (lambda: rms_norm("x", torch.ones(4), EPS), TypeError, "^x"),
    (lambda: rms_norm(torch.ones(()), torch.ones(4), EPS), ValueError, "^x"),
    (lambda: rms_norm(torch.ones(2, 4), torch.ones(5), EPS), ValueError, "^weight"),
    (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), float("nan")), ValueError, "^eps"),
    (lambda: rms_norm(torch.ones(2, 4), torch.ones(4), EPS, backend="cuda"), ValueError, "^backend"),
], ids=["x-type", "x-0dim", "weight-shape", "eps-nan", "backend"])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("t,d", [(1, 384), (5, 100), (3, 7168)], ids=str)
def test_residual_sum_is_torch_and_the_norm_close(t, d):
    x, r = _rows(t, d, seed=2), _rows(t, d, seed=3)
    w = (1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    normed, total = rms_norm(x, w, EPS, residual=r, backend="triton")
    want_normed, want_total = rms_norm_reference(x, w, EPS, residual=r)
    assert torch.equal(total, x + r) and torch.equal(want_total, x + r)
    _check_close(normed, want_normed)


def test_residual_errors_and_the_module():
    with pytest.raises(ValueError, match="^residual"):
        rms_norm(torch.ones(2, 4), torch.ones(4), EPS, residual=torch.ones(2, 5))
    m = RMSNorm(64, EPS)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    normed, total = m(x, residual=r)
    assert torch.equal(total, x + r) and torch.equal(normed, m(x + r))


@pytest.mark.parametrize("shape", [(1, 7), (3, 1024), (2, 1500), (2, 3, 64)], ids=str)
def test_silu_mul_kernel_matches_torch(shape):
    from dsa.kernels import silu_mul, silu_mul_reference
    g, u = _rows(int(torch.tensor(shape[:-1]).prod()), shape[-1], 4).view(shape), _rows(
        int(torch.tensor(shape[:-1]).prod()), shape[-1], 5).view(shape)
    got = silu_mul(g, u, backend="triton")
    _check_close(got, silu_mul_reference(g, u))
    assert got.shape == shape and got.is_contiguous()


def test_silu_mul_routing_and_errors():
    from dsa.kernels import silu_mul, silu_mul_reference
    g, u = torch.randn(2, 8), torch.randn(2, 8)
    assert torch.equal(silu_mul(g, u), silu_mul_reference(g, u))  # float32, CPU: torch's ops
    with pytest.raises(TypeError, match="^silu_mul"):
        silu_mul(g, u, backend="triton")
    with pytest.raises(ValueError, match="^up"):
        silu_mul(g, torch.randn(2, 9))
    assert silu_mul(g[:0].bfloat16(), u[:0].bfloat16(), backend="triton").shape == (0, 8)
