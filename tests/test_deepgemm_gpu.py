"""``backend="deepgemm"`` against the Triton kernels on a Hopper GPU where ``deep_gemm`` is built from
source (marker ``gpu``).

Parity on the same inputs: identical ``-inf`` masks (each row's window, positions past the block
table, block ids outside ``[0, NB)``), ``calc_diff < 1e-6`` over the finite entries (another
summation order, so not bit for bit), and top-2048 sets that are equal except at near-ties (a
position selected by one and not the other lies within twice the row's largest difference of the
k-th value; ``dsa.testing.topk_agreement``). Each test prints its numbers (``PARITY`` lines, run
with ``-s``). Also: NaN-poisoned rows no request owns change nothing, 20 runs are bitwise equal,
and a captured CUDA graph replays new lengths and queries as an eager call computes them.

Building DeepGEMM on the H200 image (2026-12-01, its commit 54e2261, cutlass f3fde58, fmt 553ec11):
setuptools compiled the extension with ``/opt/gcc/bin/g++``, and the extension came out holding
libstdc++'s own code (codecvt, ostream); its first JIT call segfaulted on a locale facet of the wrong
type (``std::regex`` in its include scan; ``std::ostringstream`` in its hash once that scan was
rewritten). With ``LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6`` (the process's libstdc++
first) every call worked, checked with that scan rewritten; building with the system ``g++`` is
the likely cure, not yet tried.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels import deepgemm
from dsa.testing import calc_diff, topk_agreement
from test_indexer_kernels_gpu import DI, MAX_S, P, paged  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not deepgemm.available(), reason="deep_gemm is not importable")]
HI, TOPK = 64, 2048


def _queries(b, n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q8 = torch.randn(b, n, HI, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    return q8, torch.randn(b, n, HI, device="cuda", generator=gen)


def _windows(seq_lens, n, width):
    """``lengths [B * N]`` of the decode rows: row ``b * N + j`` sees ``[0, S_b - N + j]``."""
    j = torch.arange(n, device=seq_lens.device)
    return (seq_lens.long()[:, None] - n + 1 + j).clamp(0, width).view(-1).to(torch.int32)


def assert_parity(name, theirs, ours, lengths, starts=None):
    """Same masks, calc_diff < 1e-6, top-k sets equal except at near-ties; prints the numbers."""
    assert theirs.shape == ours.shape and theirs.dtype == torch.float32
    finite = torch.isfinite(ours)
    wrong = (torch.isfinite(theirs) != finite) | (~finite & (theirs != ours))
    assert not wrong.any(), f"{name}: {int(wrong.sum())} entries break the -inf mask, first at {wrong.nonzero()[:4]}"
    report = topk_agreement(ours, theirs, lengths, TOPK, starts)
    print(f"\nPARITY {name}: {report}")
    assert report["calc_diff"] < 1e-6, f"{name}: calc_diff {report['calc_diff']:.3g} (want < 1e-6)"
    assert report["max_tie_gap"] <= 2.001, f"{name}: a top-k difference is no near-tie: {report}"


@pytest.mark.parametrize("n", [1, 2], ids=lambda n: f"N{n}")
def test_paged_parity(paged, n):
    cache, clean, table, lens = paged
    q8, w = _queries(64, n, seed=n)
    theirs = K.indexer_logits_paged(q8, w, cache, table, lens, P, MAX_S, backend="deepgemm")
    ours = K.indexer_logits_paged(q8, w, cache, table, lens, P, MAX_S)
    assert_parity(f"paged B=64 N={n} S<=128K", theirs, ours, _windows(lens, n, MAX_S))
    assert torch.equal(theirs, K.indexer_logits_paged(q8, w, clean, table, lens, P, MAX_S, backend="deepgemm"))
    for _ in range(20):
        assert torch.equal(theirs, K.indexer_logits_paged(q8, w, cache, table, lens, P, MAX_S, backend="deepgemm"))


def test_paged_masks_what_deepgemm_does_not_write(paged):
    """A narrow block table, ids outside ``[0, NB)`` (and -1), an output wider than the table, S < N."""
    cache, _, table, lens = paged
    table, lens = table[:8, :100].clone(), lens[:8].clone()  # requests 0 and 5 hold 128K positions
    table[0, 7], table[5, 0], table[5, 99] = cache.shape[0] + 5, -1, -7
    q8, w = _queries(8, 2, seed=5)
    width = 100 * P + 50
    theirs = K.indexer_logits_paged(q8, w, cache, table, lens, P, width, backend="deepgemm")
    ours = K.indexer_logits_paged(q8, w, cache, table, lens, P, width)
    assert int(lens[1]) == 1 and torch.isinf(theirs[2]).all(), "S = 1 < N: row 0 of request 1 sees nothing"
    for rows, cols in ((slice(0, 2), slice(7 * P, 8 * P)), (slice(10, 12), slice(0, P)),
                       (slice(10, 12), slice(99 * P, 100 * P)), (slice(None), slice(100 * P, None))):
        assert torch.isinf(theirs[rows, cols]).all()
    assert_parity("paged B=8 N=2 narrow table, bad ids", theirs, ours, _windows(lens, 2, width))


def test_paged_graph_replay(paged):
    cache, _, table, lens = paged
    q8, w = _queries(64, 1, seed=9)
    seq_lens = lens.clone()
    run = lambda: K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, MAX_S, backend="deepgemm")  # noqa: E731
    run()  # compiles on the first call: never inside a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    seq_lens.copy_((lens - 777).clamp_min(1))  # the next step: other lengths and queries
    q8.copy_(_queries(64, 1, seed=10)[0])
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
    assert_parity("paged B=64 N=1 graph replay", out, K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, MAX_S),
                  _windows(seq_lens, 1, MAX_S))


def test_ragged_parity():
    t, s = 2047, 40000
    gen = torch.Generator(device="cuda").manual_seed(7)
    q8 = torch.randn(t, HI, DI, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(t, HI, device="cuda", generator=gen)
    k8 = (torch.randn(s, DI, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    k_scale = torch.rand(s, device="cuda", generator=gen) + 0.5
    starts = torch.randint(0, 1000, (t,), dtype=torch.int32, device="cuda", generator=gen)
    ends = torch.arange(s - t + 1, s + 1, dtype=torch.int32, device="cuda")
    starts[5], ends[5] = 300, 300  # an empty range
    starts[6], ends[6] = 500, 100  # an inverted one
    starts[7] = s + 3  # one past S
    theirs = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="deepgemm")
    ours = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends)
    assert torch.isinf(theirs[5:8]).all()
    finite = torch.isfinite(ours)
    assert torch.equal(torch.isfinite(theirs), finite) and torch.equal(theirs[~finite], ours[~finite])
    assert calc_diff(theirs[finite], ours[finite]) < 1e-6
    sub = torch.arange(8, t, 31, device="cuda")  # the top-k of a subset of the rows
    assert_parity("ragged T=2047 S=40000", theirs[sub], ours[sub], (ends - starts)[sub], starts[sub])
