"""Non-finite inputs give the same bytes on both backends, by the rule of ``dsa.kernels.layouts``.

A quantization group (indexer key row, query (token, head) row, 128-wide kv_c tile) holding NaN or
+-inf is stored as NaN: value bytes 0x7F, scale 0x7FC00000; NaN query weights are 0x7FC00000; finite
groups are quantized as if the others were not there; bf16 k_pe is copied bit for bit.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.layouts import FP8_NAN_BYTE, FP32_NAN_BITS, latent_fp8_views

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN rows
NEG_NAN = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()  # 0xFFC00000: -NaN


def _poisoned_rows(rows, width, gen):
    """bf16 ``[rows, width]``: row 0 finite, then NaN, +inf, -inf, -NaN, NaN and inf together, a huge
    finite row, and random rows with a single non-finite element at a random place."""
    x = torch.randn(rows, width, generator=gen) * 3
    bad = [float("nan"), float("inf"), float("-inf"), NEG_NAN]
    for i, v in enumerate(bad, start=1):
        x[i, (7 * i) % width] = v
    x[5, 1], x[5, 9] = float("nan"), float("-inf")
    x[6] = x[6] * 1e30  # finite, far past e4m3
    for i in range(7, rows, 2):
        x[i, int(torch.randint(0, width, (1,), generator=gen))] = bad[i % 4]
    return x.to(torch.bfloat16)


def _nonfinite(x):
    return ~torch.isfinite(x.float()).all(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_indexer_key_write_nonfinite_keys(backend, hadamard):
    g = torch.Generator().manual_seed(1)
    p, t = 16, 21
    k = _poisoned_rows(t, 128, g).to(DEVICE)
    cache = torch.zeros(2, p * 132, dtype=torch.uint8, device=DEVICE)
    K.indexer_key_write(cache, k, torch.arange(t, device=DEVICE), p, hadamard, backend=backend)
    expect = torch.zeros_like(cache)
    K.indexer_key_write(expect, k, torch.arange(t, device=DEVICE), p, hadamard, backend="torch")
    assert torch.equal(cache, expect)
    k8, scale = K.layouts.indexer_cache_views(cache, p)
    k8, scale = k8.reshape(-1, 128)[:t].view(torch.uint8), scale.reshape(-1)[:t].view(torch.int32)
    bad = _nonfinite(K.hadamard(k) if hadamard else k)
    assert bad[1:6].all() and not bad[[0, 6]].any()
    assert bool((k8[bad] == FP8_NAN_BYTE).all()) and bool((scale[bad] == FP32_NAN_BITS).all())
    finite8, finite_scale = K.quant_ue8m0(K.hadamard(k[~bad]) if hadamard else k[~bad])  # as if alone
    assert torch.equal(k8[~bad], finite8.view(torch.uint8)) and torch.equal(scale[~bad], finite_scale[:, 0].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_indexer_query_prep_nonfinite_queries_and_weights(backend, hadamard):
    g = torch.Generator().manual_seed(2)
    t, hi = 5, 6
    q = _poisoned_rows(t * hi, 128, g).view(t, hi, 128).to(DEVICE)
    w = torch.randn(t, hi, generator=g)
    w[0, 0], w[0, 1], w[0, 2], w[4, 5] = float("nan"), float("inf"), NEG_NAN, float("-inf")
    w = w.to(DEVICE)
    q8, weights = K.indexer_query_prep(q, w, hadamard, backend=backend)
    ref8, ref_w = K.indexer_query_prep(q, w, hadamard, backend="torch")
    assert torch.equal(q8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(weights.view(torch.int32), ref_w.view(torch.int32))
    bad = _nonfinite(K.hadamard(q) if hadamard else q)  # [T, HI]
    assert bool((q8.view(torch.uint8)[bad] == FP8_NAN_BYTE).all())
    nan_w = torch.isnan(weights)
    assert torch.equal(nan_w, bad | torch.isnan(w)), "a weight is NaN exactly where its row or w is"
    assert bool((weights.view(torch.int32)[nan_w] == FP32_NAN_BITS).all())
    assert torch.isposinf(weights[0, 1]) or bad[0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_latent_write_nonfinite_tiles(backend):
    g = torch.Generator().manual_seed(3)
    t = 19
    kv_c = _poisoned_rows(t, 512, g).to(DEVICE)  # one bad element spoils one of the four tiles
    k_pe = _poisoned_rows(t, 64, g).to(DEVICE)  # bf16: copied as it is
    cache = torch.zeros(2, 16, 656, dtype=torch.uint8, device=DEVICE)
    K.latent_write(cache, kv_c, k_pe, torch.arange(t, device=DEVICE), backend=backend)
    expect = torch.zeros_like(cache)
    K.latent_write(expect, kv_c, k_pe, torch.arange(t, device=DEVICE), backend="torch")
    assert torch.equal(cache, expect)
    kv8, scale, pe = (v.reshape(32, -1)[:t] for v in latent_fp8_views(cache))
    tiles_bad = _nonfinite(kv_c.view(t, 4, 128))  # [T, 4]
    assert tiles_bad.any() and not tiles_bad.all()
    kv8 = kv8.view(torch.uint8).view(t, 4, 128)
    assert bool((kv8[tiles_bad] == FP8_NAN_BYTE).all()) and bool((kv8[~tiles_bad] != FP8_NAN_BYTE).all())
    assert bool((scale.view(torch.int32)[tiles_bad] == FP32_NAN_BITS).all())
    assert torch.equal(pe.view(torch.int16), k_pe.view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_latent_write_copies_nonfinite_bits(backend):
    g = torch.Generator().manual_seed(4)
    kv_c, k_pe = _poisoned_rows(9, 512, g).to(DEVICE), _poisoned_rows(9, 64, g).to(DEVICE)
    cache = torch.zeros(1, 16, 576, dtype=torch.bfloat16, device=DEVICE)
    K.latent_write(cache, kv_c, k_pe, torch.arange(9, device=DEVICE), backend=backend)
    assert torch.equal(cache[0, :9].view(torch.int16), torch.cat((kv_c, k_pe), -1).view(torch.int16))
