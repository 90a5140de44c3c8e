"""Indexer Triton kernels on a CUDA GPU at production shapes (marker ``gpu``).

Key write and query prep: bytes equal the reference, one kernel launch each. Paged logits:
``B=64``, ``N`` in 1..3, ``HI`` in {32, 64}, ``S`` up to 128K over random non-contiguous block
tables; 20 runs bitwise equal; NaN-poisoned rows a request does not own change nothing; a cache
over 4 GiB; capture and replay in a CUDA graph with ``max_seq_len``. Ragged logits: a causal chunk
(portable and Hopper kernels), and the Hopper kernel against the portable one up to 1M keys.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels import indexer_logits_ragged_hopper as hopper_ragged
from dsa.kernels.layouts import indexer_cache_views
from dsa.testing import random_block_tables
from kernel_utils import owned_slots, poison_unowned_indexer_rows
from test_indexer_kernels import assert_logits_match

pytestmark = pytest.mark.gpu
P, DI = 64, 128
MAX_S = 131072


def _launches(fn) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.fixture(scope="module")
def paged():
    """64 requests (S from 1 to 128K, block boundaries included) over random non-contiguous
    blocks, keys written by the Triton key write (checked against the reference's bytes), then
    every row no request owns poisoned with NaN. Returns (cache, clean copy, table, seq_lens)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, MAX_S + 1, (64,), generator=gen)
    lens[:6] = torch.tensor([MAX_S, 1, P, P + 1, 3, MAX_S - 1])
    table, nb = random_block_tables(lens.tolist(), P, generator=gen, extra_blocks=64)
    table, lens = table.cuda(), lens.to(torch.int32).cuda()
    slots = owned_slots(table, lens.tolist(), P)
    k = (torch.randn(len(slots), DI, device="cuda") * 3).to(torch.bfloat16)
    cache = torch.zeros(nb, P * (DI + 4), dtype=torch.uint8, device="cuda")
    expect = cache.clone()
    K.indexer_key_write(cache, k, slots, P, True)
    K.indexer_key_write(expect, k, slots, P, True, backend="torch")
    assert torch.equal(cache, expect)
    del expect, k
    clean = cache.clone()
    poison_unowned_indexer_rows(cache, slots, P)
    return cache, clean, table, lens


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_key_write_bytes_and_one_launch(hadamard, slot_dtype):
    t, nb = 8191, 200
    k = (torch.randn(t, DI, device="cuda") * torch.rand(t, 1, device="cuda") * 10).to(torch.bfloat16)
    slots = torch.randperm(nb * P, device="cuda")[:t]
    slots[::97] = -1
    slots = slots.to(slot_dtype)
    cache = torch.randint(0, 256, (nb, P * (DI + 4)), dtype=torch.uint8, device="cuda")
    expect = cache.clone()
    K.indexer_key_write(cache, k, slots, P, hadamard)
    K.indexer_key_write(expect, k, slots, P, hadamard, backend="torch")
    assert torch.equal(cache, expect)
    names = _launches(lambda: K.indexer_key_write(cache, k, slots, P, hadamard))
    assert len(names) == 1 and "key_write" in names[0], names


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_query_prep_bytes_and_one_launch(hadamard):
    t, hi = 4099, 64
    q = (torch.randn(t, hi, DI, device="cuda") * torch.rand(t, hi, 1, device="cuda") * 10).to(torch.bfloat16)
    w = torch.randn(t, hi, device="cuda")
    q8, weights = K.indexer_query_prep(q, w, hadamard)
    ref_q8, ref_w = K.indexer_query_prep(q, w, hadamard, backend="torch")
    assert torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8))
    assert torch.equal(weights, ref_w)
    names = _launches(lambda: K.indexer_query_prep(q, w, hadamard))
    assert len(names) == 1 and "query_prep" in names[0], names


@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("hi", [32, 64], ids=lambda h: f"HI{h}")
def test_paged_logits_production(paged, n, hi):
    cache, clean, table, lens = paged
    gen = torch.Generator(device="cuda").manual_seed(n * 100 + hi)
    q8 = torch.randn(64, n, hi, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(64, n, hi, device="cuda", generator=gen)
    out = K.indexer_logits_paged(q8, w, cache, table, lens, P)
    assert_logits_match(out, K.indexer_logits_paged(q8, w, clean, table, lens, P, backend="torch"))
    assert torch.equal(out, K.indexer_logits_paged(q8, w, clean, table, lens, P))  # poison changes nothing
    for _ in range(20):
        assert torch.equal(out, K.indexer_logits_paged(q8, w, cache, table, lens, P))


def test_paged_logits_cuda_graph(paged):
    cache, _, table, lens = paged
    n, hi, width = 2, 64, MAX_S + 100
    q8 = torch.randn(64, n, hi, DI, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(64, n, hi, device="cuda")
    seq_lens = lens.clone()
    K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, width)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, width)
    seq_lens.copy_((lens - 7).clamp_min(1))  # new step: shorter rows, new queries
    q8.copy_(torch.randn(64, n, hi, DI, device="cuda").to(torch.float8_e4m3fn))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_logits_match(out, K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, width, backend="torch"))


def test_cache_over_4gib():
    nb = (4 << 30) // (P * (DI + 4)) + 8000  # 4.3 GB: every block of the requests lies past 4 GiB
    cache = torch.zeros(nb, P * (DI + 4), dtype=torch.uint8, device="cuda")
    lens = [5000, 4097, 64, 777]
    gen = torch.Generator().manual_seed(1)
    table, used = random_block_tables(lens, P, generator=gen)
    table = (table + nb - used).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    slots = owned_slots(table, lens, P)
    k = (torch.randn(len(slots), DI, device="cuda") * 3).to(torch.bfloat16)
    K.indexer_key_write(cache, k, slots, P, True)
    k8, scale = indexer_cache_views(cache, P)
    ref8, ref_scale = K.quant_ue8m0(K.hadamard(k))
    assert torch.equal(k8[slots // P, slots % P].view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(scale[slots // P, slots % P], ref_scale[:, 0])
    q8 = torch.randn(4, 2, 64, DI, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(4, 2, 64, device="cuda")
    assert_logits_match(K.indexer_logits_paged(q8, w, cache, table, seq_lens, P),
                        K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, backend="torch"))


def _ragged_inputs(t, s, hi, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q8 = torch.randn(t, hi, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(t, hi, device="cuda", generator=gen)
    k8 = torch.randn(s, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    k_scale = torch.rand(s, device="cuda", generator=gen) + 0.5
    return q8, w, k8, k_scale, gen


RAGGED_BACKENDS = ["triton", "hopper"] if torch.cuda.is_available() and \
    hopper_ragged.unsupported_reason(torch.device("cuda"), 64, DI) is None else ["triton"]


@pytest.mark.parametrize("backend", RAGGED_BACKENDS)
@pytest.mark.parametrize("hi", [32, 64], ids=lambda h: f"HI{h}")
def test_ragged_logits_causal_chunk(hi, backend):
    """600 rows (a partial last row tile) against 6,000 keys (a partial last key tile), each row's
    range a causal tail from a random start; 20 runs bitwise equal."""
    t, s = 600, 6000
    q8, w, k8, k_scale, gen = _ragged_inputs(t, s, hi, hi)
    ends = torch.arange(s - t + 1, s + 1, dtype=torch.int32, device="cuda")
    starts = torch.randint(0, 100, (t,), dtype=torch.int32, device="cuda", generator=gen)
    out = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend=backend)
    assert_logits_match(out, K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="torch"))
    for _ in range(20):
        assert torch.equal(out, K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend=backend))


@pytest.mark.skipif(len(RAGGED_BACKENDS) < 2, reason="the Hopper ragged kernel cannot run on this GPU or Triton")
@pytest.mark.parametrize("t,s", [(64, 1 << 20), (400, 160000), (1, 131073), (9, 70), (4, 64)],
                         ids=["64x1M", "400x160K", "1x128K+1", "9x70", "4x64"])
def test_ragged_hopper_equals_the_portable_kernel(t, s):
    """The Gluon kernel against the portable one: the same logits bit for bit (the same wgmma
    accumulator layout, so the same head-sum order; empty rows, ranges that skip whole tiles at both
    ends, a row past S); each row's logits are the same bits when computed alone."""
    q8, w, k8, k_scale, gen = _ragged_inputs(t, s, 64, t + s)
    ends = torch.randint(1, s + 1, (t,), dtype=torch.int32, device="cuda", generator=gen)
    starts = (ends * torch.rand(t, device="cuda", generator=gen)).to(torch.int32)
    starts[0], ends[0] = s // 3, s // 3  # an empty row
    if t > 2:
        starts[1], ends[1] = s - 1, s + 5  # a range past S
        starts[2], ends[2] = 0, s
    out = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="hopper")
    portable = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="triton")
    assert_logits_match(out, portable)
    assert torch.equal(out, portable), f"{(out != portable).sum().item()} logits differ from the portable kernel's"
    for r in sorted({0, t // 2, t - 1}):
        alone = K.indexer_logits_ragged(q8[r:r + 1], w[r:r + 1], k8, k_scale, starts[r:r + 1], ends[r:r + 1],
                                        backend="hopper")
        assert torch.equal(alone[0], out[r]), f"row {r}: its logits depend on the rows beside it"
