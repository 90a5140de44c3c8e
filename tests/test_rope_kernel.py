"""rope_rotate's Triton kernel (the interpreter here) against the torch ops: both layouts, the model's strided
views, in place, other ranks, empty rows; the identity rotation exact; the errors naming the argument."""
import pytest
import torch

from dsa.kernels import rope_at, rope_rotate, rope_rotate_reference, yarn_cos_sin
from test_rms_norm import _ulps


def _rot(t: int, d: int, outside: bool = False) -> torch.Tensor:
    cos, sin = yarn_cos_sin(4096, d, 1e4, None)
    pos = torch.arange(t, dtype=torch.int64) * 37 % 4096
    if outside:
        pos[::2] = -1  # outside the table: the identity rotation
    return rope_at(pos, cos, sin)


def _x(shape, seed=0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    u = _ulps(got, want)
    assert u.max() <= 1, f"{int((u > 1).sum())} of {u.numel()} values more than one bf16 ulp apart"
    assert (u > 0).float().mean() < 0.02, f"{int((u > 0).sum())} of {u.numel()} values differ"


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (3, 7, 64), (2, 40, 64), (4, 3, 16)], ids=str)
def test_kernel_matches_the_torch_ops(shape, interleaved):
    x, rot = _x(shape), _rot(shape[0], shape[-1])
    _close(rope_rotate(x, rot, interleaved, backend="triton"), rope_rotate_reference(x, rot, interleaved))


def test_the_model_views_and_in_place():
    q = _x((6, 16, 192))  # MLA's q: its last 64 dims are q_pe
    rot = _rot(6, 64)
    _close(rope_rotate(q[..., 128:], rot, True, backend="triton"), rope_rotate_reference(q[..., 128:], rot, True))
    k = _x((6, 128))  # the indexer's key: its first 64 dims rotate, in place
    want = torch.cat((rope_rotate_reference(k[:, :64], rot, False), k[:, 64:]), dim=-1)
    out = rope_rotate(k[:, :64], rot, False, out=k[:, :64], backend="triton")
    assert out.data_ptr() == k.data_ptr()
    _close(k, want)
    assert torch.equal(k[:, 64:], want[:, 64:])  # the rest untouched


def test_other_ranks_and_out_strides():
    x, rot = _x((3, 2, 5, 32)), _rot(3, 32)
    _close(rope_rotate(x, rot, True, backend="triton"), rope_rotate_reference(x, rot, True))
    out = torch.zeros(3, 32, 2, dtype=torch.bfloat16).transpose(1, 2)  # [3, 2, 32], last stride 2
    got = rope_rotate(x[:, 0, 0:2], rot, True, out=out, backend="triton")
    assert got is out
    _close(out, rope_rotate_reference(x[:, 0, 0:2], rot, True))


def test_outside_positions_are_exact_and_empty_rows():
    x = _x((6, 4, 64))
    rot = _rot(6, 64, outside=True)
    got = rope_rotate(x, rot, True, backend="triton")
    assert torch.equal(got[::2], x[::2])
    empty = rope_rotate(x[:0], rot[:0], True, backend="triton")
    assert empty.shape == (0, 4, 64)


def test_auto_keeps_the_torch_ops_off_cuda_and_for_float32():
    x, rot = _x((3, 64)), _rot(3, 64)
    assert torch.equal(rope_rotate(x, rot, True), rope_rotate_reference(x, rot, True))
    with pytest.raises(TypeError, match="^rope_rotate"):
        rope_rotate(x.float(), rot, True, backend="triton")


@pytest.mark.parametrize("call,exc,match", [
    (lambda: rope_rotate(torch.ones(3, 63), _rot(3, 64), True), ValueError, "^x"),
    (lambda: rope_rotate(torch.ones(3, 64), _rot(2, 64), True), ValueError, "^rot"),
    (lambda: rope_rotate(torch.ones(3, 64), _rot(3, 64).real, True), TypeError, "^rot"),
    (lambda: rope_rotate(torch.ones(3, 64), _rot(3, 64), True, out=torch.ones(3, 32)), ValueError, "^out"),
], ids=["x-odd", "rot-rows", "rot-dtype", "out-shape"])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_rope_at_kernel_is_the_gather(dtype):
    from dsa.kernels import rope_at_reference
    cos, sin = yarn_cos_sin(300, 64, 1e4, None)
    pos = torch.tensor([0, 5, 299, 300, -1, 17, 2 ** 31 - 1], dtype=dtype)  # three outside the table
    got = rope_at(pos, cos, sin, backend="triton")
    assert got.dtype == torch.complex64 and torch.equal(got, rope_at_reference(pos, cos, sin))
    assert torch.equal(got[[3, 4, 6]], torch.ones(3, 32, dtype=torch.complex64))
    assert rope_at(pos[:0], cos, sin, backend="triton").shape == (0, 32)
