"""indexer_topk_paged on a CUDA GPU at production shapes (marker ``gpu``).

B = 64 requests of up to 128K positions over random non-contiguous blocks (the NaN-poisoned cache
of ``test_indexer_kernels_gpu``), N in {1, 2}, HI = 64, k in {1, 64, 2048, 4096}: the same slot
sets as the Triton pair ``topk_slots(indexer_logits_paged(...))``; the logits it scores equal
``indexer_logits_paged``'s bit for bit; a window built against the sample (the whole-row path);
20 runs bitwise equal; CUDA-graph capture and replay; four Triton launches and a memset.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.indexer_topk_paged import _SAMPLE, _indexer_topk_paged_triton
from dsa.kernels.layouts import indexer_cache_views
from test_indexer_kernels_gpu import DI, MAX_S, P, _launches, paged  # noqa: F401 (the fixture)
from test_indexer_topk_paged import assert_same_slots, unfused
from test_topk_kernels import _sampled_columns

pytestmark = pytest.mark.gpu
HI = 64


def _queries(b, n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q8 = torch.randn(b, n, HI, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    return q8, torch.randn(b, n, HI, device="cuda", generator=gen)


@pytest.mark.parametrize("n", [1, 2], ids=lambda n: f"N{n}")
def test_production_equals_the_triton_pair(paged, n):
    cache, clean, table, lens = paged
    q8, w = _queries(64, n, seed=n)
    out = K.indexer_topk_paged(q8, w, cache, table, lens, P, 2048, MAX_S)
    ref, lengths = unfused(q8, w, cache, table, lens, 2048, MAX_S, "triton", p=P)
    assert_same_slots(out, ref, lengths, 2048)
    assert torch.equal(out, K.indexer_topk_paged(q8, w, clean, table, lens, P, 2048, MAX_S))  # poison: no effect
    for _ in range(20):
        assert torch.equal(out, K.indexer_topk_paged(q8, w, cache, table, lens, P, 2048, MAX_S))


@pytest.mark.parametrize("k", [1, 64, 4096], ids=lambda k: f"k{k}")
def test_any_k(paged, k):
    cache, _, table, lens = paged
    q8, w = _queries(64, 1, seed=k)
    out = K.indexer_topk_paged(q8, w, cache, table, lens, P, k, MAX_S)
    ref, lengths = unfused(q8, w, cache, table, lens, k, MAX_S, "triton", p=P)
    assert_same_slots(out, ref, lengths, k)


@pytest.mark.parametrize("n", [1, 2], ids=lambda n: f"N{n}")
def test_scored_logits_are_the_paged_logits(paged, n):
    cache, _, table, lens = paged
    q8, w = _queries(64, n, seed=10 + n)
    logits = torch.full((64 * n, MAX_S), float("-inf"), device="cuda")
    slots = _indexer_topk_paged_triton(q8, w, cache, table, lens, P, 2048, MAX_S, logits=logits)
    assert torch.equal(logits, K.indexer_logits_paged(q8, w, cache, table, lens, P, MAX_S))
    ref, lengths = unfused(q8, w, cache, table, lens, 2048, MAX_S, "triton", p=P)
    assert_same_slots(slots, ref, lengths, 2048)


def test_a_window_built_against_the_sample(paged):
    """Request 0's sampled positions hold keys aligned with its query: fewer than k positions reach
    the guess and the finish kernel scores the window again; the set is still the pair's."""
    cache, _, table, lens = paged
    cache = cache.clone()
    q8, w = _queries(64, 1, seed=3)
    w.abs_()
    s = int(lens[0])
    sampled = _sampled_columns(s, _SAMPLE).cuda()
    k8, scale = indexer_cache_views(cache, P)
    slots = table[0].long()[sampled // P] * P + sampled % P
    k8.view(torch.uint8)[slots // P, slots % P] = q8[0, 0, 0].view(torch.uint8)
    scale[slots // P, slots % P] = 64.0
    scratch = {}
    out = _indexer_topk_paged_triton(q8, w, cache, table, lens, P, 2048, MAX_S, scratch=scratch)
    assert scratch["hist"][0].sum() < 2048, "the guess must fail"
    ref, lengths = unfused(q8, w, cache, table, lens, 2048, MAX_S, "triton", p=P)
    assert_same_slots(out, ref, lengths, 2048)


def test_cuda_graph_and_launches(paged):
    cache, _, table, lens = paged
    q8, w = _queries(64, 2, seed=5)
    seq_lens = lens.clone()
    run = lambda: K.indexer_topk_paged(q8, w, cache, table, seq_lens, P, 2048, MAX_S + 100)  # noqa: E731
    names = _launches(run)
    for kernel in ("_sample_kernel", "_fused_kernel", "_place_kernel", "_finish_kernel"):
        assert sum(kernel in x for x in names) == 1, names
    assert len(names) <= 5, names  # and the memset of the sample's tickets
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    seq_lens.copy_((lens - 7).clamp_min(1))  # new step: shorter rows, new queries
    q8.copy_(torch.randn(64, 2, HI, DI, device="cuda").to(torch.float8_e4m3fn))
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    ref, lengths = unfused(q8, w, cache, table, seq_lens, 2048, MAX_S + 100, "triton", p=P)
    assert_same_slots(out, ref, lengths, 2048)
