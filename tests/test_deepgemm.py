"""``backend="deepgemm"`` of the indexer logits without a GPU: it is refused by name when ``deep_gemm``
is missing, its limits and the exact-precision refusal come before any call into ``deep_gemm``, and
``"auto"`` never routes to it, even where ``deep_gemm`` imports. Parity with the Triton kernels runs
on a GPU where DeepGEMM is built (``tests/test_deepgemm_gpu.py``).
"""
import sys
import types

import pytest
import torch

from dsa import kernels as K
from dsa.kernels import deepgemm

P, DI = 64, 128


def _paged(hi=64, n=1, p=P, exact=False):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([100, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    if exact:
        q, cache = torch.randn(2, n, hi, DI, generator=gen), torch.randn(4, p, DI, generator=gen)
    else:
        q = torch.randn(2, n, hi, DI, generator=gen).to(torch.float8_e4m3fn)
        cache = torch.randint(0, 120, (4, p * (DI + 4)), dtype=torch.uint8, generator=gen)
        cache[:, p * DI:].view(torch.float32).fill_(0.5)
    return q, torch.randn(2, n, hi, generator=gen), cache, table, lens, p


def _ragged(hi=64):
    gen = torch.Generator().manual_seed(1)
    q8 = torch.randn(5, hi, DI, generator=gen).to(torch.float8_e4m3fn)
    k8 = torch.randn(33, DI, generator=gen).to(torch.float8_e4m3fn)
    starts = torch.tensor([0, 3, 10, 0, 32], dtype=torch.int32)
    ends = torch.tensor([33, 9, 10, 1, 33], dtype=torch.int32)
    return q8, torch.randn(5, hi, generator=gen), k8, torch.rand(33, generator=gen) + 0.5, starts, ends


def _call_paged(args, backend):
    q, w, cache, table, lens, p = args
    return K.indexer_logits_paged(q, w, cache, table, lens, p, 128, backend=backend)


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    """``deep_gemm`` importable, as a module whose every function fails the test if called."""
    calls = []

    def called(*args, **kwargs):
        calls.append(args)
        raise AssertionError("deep_gemm was called")

    module = types.ModuleType("deep_gemm")
    for name in ("get_num_sms", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "fp8_mqa_logits"):
        setattr(module, name, called)
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(deepgemm, "available", lambda: True)
    return calls


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(deepgemm, "available", lambda: False)
    with pytest.raises(ValueError, match="indexer_logits_paged: backend='deepgemm' needs the deep_gemm package"):
        _call_paged(_paged(), "deepgemm")
    with pytest.raises(ValueError, match="indexer_logits_ragged: backend='deepgemm' needs the deep_gemm package"):
        K.indexer_logits_ragged(*_ragged(), backend="deepgemm")


@pytest.mark.parametrize("args,match", [
    (dict(hi=5), "q8: DeepGEMM's Hopper kernels take HI in 32, 64"),
    (dict(n=3), "block_size 64 and N <= 2; got block_size 64, N 3"),
    (dict(p=32), "block_size 64 and N <= 2; got block_size 32"),
    (dict(), "backend='deepgemm' needs CUDA tensors, got tensors on cpu"),
], ids=["HI5", "N3", "P32", "cpu"])
def test_paged_limits_before_any_call(fake_deep_gemm, args, match):
    with pytest.raises(ValueError, match=match):
        _call_paged(_paged(**args), "deepgemm")
    assert not fake_deep_gemm


def test_ragged_limits_before_any_call(fake_deep_gemm):
    with pytest.raises(ValueError, match="q8: DeepGEMM's Hopper kernels take HI in 32, 64"):
        K.indexer_logits_ragged(*_ragged(hi=16), backend="deepgemm")
    with pytest.raises(ValueError, match="backend='deepgemm' needs CUDA tensors"):
        K.indexer_logits_ragged(*_ragged(), backend="deepgemm")
    assert not fake_deep_gemm


def test_exact_precision_is_refused(fake_deep_gemm):
    with pytest.raises(TypeError, match="indexer_logits_paged: backend='deepgemm' takes an FP8 cache"):
        _call_paged(_paged(exact=True), "deepgemm")
    q, w, k8, k_scale, starts, ends = _ragged()
    with pytest.raises(TypeError, match="indexer_logits_ragged: backend='deepgemm' takes FP8 queries and keys"):
        K.indexer_logits_ragged(q.float(), w, k8.float(), k_scale, starts, ends, backend="deepgemm")
    assert not fake_deep_gemm


def test_auto_never_routes_to_deepgemm(fake_deep_gemm):
    """With ``deep_gemm`` importable, ``"auto"`` gives the reference's logits and calls none of it."""
    args = _paged()
    assert torch.equal(_call_paged(args, "auto"), _call_paged(args, "torch"))
    assert torch.equal(K.indexer_logits_ragged(*_ragged()), K.indexer_logits_ragged(*_ragged(), backend="torch"))
    assert not fake_deep_gemm


def test_other_ops_refuse_the_name():
    logits = torch.randn(2, 50)
    with pytest.raises(ValueError, match="backend: expected one of"):
        K.topk_indices(logits, torch.tensor([50, 20], dtype=torch.int32), 4, backend="deepgemm")
