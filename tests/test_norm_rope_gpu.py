"""rms_norm's and rope_rotate's kernels on the GPU at the model's widths and a prefill's row counts, against the torch ops."""
import pytest
import torch

from dsa.kernels import rms_norm, rms_norm_reference
from test_rms_norm import _check_close, _rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t", [1, 3, 8192], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("d", [384, 512, 1536, 7168], ids=lambda d: f"D{d}")
def test_kernel_matches_the_reference_on_cuda(t, d):
    x = _rows(t, d).cuda()
    w = (1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16).cuda()
    got = rms_norm(x, w, 1e-6)  # auto: the kernel
    _check_close(got.cpu(), rms_norm_reference(x, w, 1e-6).cpu())


def test_strided_latent_rows_on_cuda():
    base = _rows(33, 576).cuda()
    w = torch.ones(512, dtype=torch.bfloat16, device="cuda")
    _check_close(rms_norm(base[:, :512], w, 1e-6).cpu(), rms_norm_reference(base[:, :512], w, 1e-6).cpu())


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("shape", [(1, 64), (3, 128, 64), (8192, 64, 64)], ids=str)
def test_rope_kernel_matches_the_torch_ops_on_cuda(shape, interleaved):
    from dsa.kernels import rope_at, rope_rotate, rope_rotate_reference, yarn_cos_sin
    x = _rows(shape[0], shape[-1] * (shape[1] if len(shape) == 3 else 1)).view(shape).cuda()
    cos, sin = yarn_cos_sin(16384, 64, 1e4, None)
    rot = rope_at(torch.arange(shape[0], device="cuda") * 3, cos.cuda(), sin.cuda())
    _check_close(rope_rotate(x, rot, interleaved).cpu(), rope_rotate_reference(x, rot, interleaved).cpu())


def test_rope_at_kernel_is_the_gather_on_cuda():
    from dsa.kernels import rope_at, rope_at_reference, yarn_cos_sin
    cos, sin = (t.cuda() for t in yarn_cos_sin(163840, 64, 1e4, None))
    pos = torch.tensor([0, 7, 163839, 163840, -5, 2 ** 31 - 1], dtype=torch.int32, device="cuda")
    assert torch.equal(rope_at(pos, cos, sin), rope_at_reference(pos, cos, sin))


def test_residual_and_silu_mul_on_cuda():
    from dsa.kernels import silu_mul, silu_mul_reference
    x, r = _rows(8192, 7168, 2).cuda(), _rows(8192, 7168, 3).cuda()
    w = torch.ones(7168, dtype=torch.bfloat16, device="cuda")
    normed, total = rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(total, x + r)
    _check_close(normed.cpu(), rms_norm_reference(x + r, w, 1e-6).cpu())
    g, u = _rows(3, 18432, 4).cuda(), _rows(3, 18432, 5).cuda()
    _check_close(silu_mul(g, u).cpu(), silu_mul_reference(g, u).cpu())
