"""Triton top-k on a CUDA GPU at production shapes (marker ``gpu``).

``k`` 1, 64, 2048 and 4096 over rows of 64K, 128K and 1M columns: adversarial rows (ties far beyond
any bounded candidate buffer, 10-bit values, NaN/inf inside and past the length, -inf rows, rows
built against the kernel's sample), lengths 0, 1, k-1, k, k+1 and starts != 0, compared with the
reference tie-aware; ``topk_slots`` equal to ``positions_to_slots`` of the same selection; 20 runs
bitwise equal; CUDA-graph capture and replay; three Triton launches (scan, place, finish) and no memset per call,
five on the tile bound of 32 rows and more of 512K columns and more (tile maxima, bound, scan of the listed tiles, place,
finish), whose selections equal the sampled guess's.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.slots import positions_to_slots_reference
from dsa.kernels.topk import topk_indices_reference
from dsa.kernels.topk.launch import SAMPLE, topk_triton
from dsa.testing import random_block_tables
from test_topk_kernels import _sampled_columns, adversarial_rows, check_topk

pytestmark = pytest.mark.gpu
P = 64


def _rows(r, width, k, seed):
    """``r`` rows: the adversarial kinds, then random rows with lengths 0, 1, k-1, k, k+1 and starts."""
    g = torch.Generator().manual_seed(seed)
    logits, lengths, starts = adversarial_rows(width, k, g)
    extra = r - logits.shape[0]
    more = torch.randn(extra, width, generator=g)
    more[::4] = (more[::4] * 32).round()  # ties at the threshold
    special = [0, 1, k - 1, k, k + 1][:extra]
    n_rand = max(0, extra // 2 - len(special))
    more_len = torch.cat((torch.tensor(special), torch.randint(min(k + 2, width), width + 2, (n_rand,), generator=g),
                          torch.full((extra - len(special) - n_rand,), width))).to(torch.int32)
    more_start = torch.zeros(extra, dtype=torch.int32)
    more_start[1::3] = torch.randint(0, width // 2, (len(range(1, extra, 3)),), generator=g).int()
    return [x.cuda() for x in (torch.cat((logits, more)), torch.cat((lengths, more_len)),
                               torch.cat((starts, more_start)))]


@pytest.mark.parametrize("r,width,k", [(64, 65536, 2048), (64, 131072, 2048), (24, 131072, 4096),
                                       (16, 4096, 2048), (12, 2048, 2048)],
                         ids=["64x64K-k2048", "64x128K-k2048", "24x128K-k4096", "16x4K-k2048", "12x2K-dense"])
def test_matches_reference_tie_aware(r, width, k):
    logits, lengths, starts = _rows(r, width, k, seed=width + k)
    out = K.topk_indices(logits, lengths, k, starts)
    check_topk(out, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))


@pytest.mark.parametrize("k", [1, 64, 2048, 4096], ids=lambda k: f"k{k}")
def test_million_columns(k):
    g = torch.Generator().manual_seed(k)
    width = 1 << 20
    logits = torch.randn(3, width, generator=g)
    logits[1] = (logits[1] * 16).round()  # ~100 distinct values: a huge tie at the threshold
    logits[2] = 5.0
    logits = logits.cuda()
    lengths = torch.tensor([width, width - 1000, width], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 700, 0], dtype=torch.int32, device="cuda")
    out = K.topk_indices(logits, lengths, k, starts)
    check_topk(out, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
    assert torch.equal(out[2].cpu(), torch.arange(k, dtype=torch.int32))  # ties: the first k columns


def _slots_inputs(r, width, seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(width // 2, width + 1, (r,), generator=g)
    seq[0] = width
    table, _ = random_block_tables(seq.tolist(), P, generator=g, extra_blocks=8)
    table = table[:, :-1]  # the last page of the longest requests falls outside the table
    return table.cuda(), torch.arange(r, dtype=torch.int32).flip(0).cuda(), seq.to(torch.int32).cuda()


def test_slots_equal_positions_to_slots():
    r, width, k = 64, 65536, 2048
    logits, lengths, starts = _rows(r, width, k, seed=5)
    table, row_to_req, seq_lens = _slots_inputs(r, width, seed=5)
    pos = K.topk_indices(logits, lengths, k, starts)
    slots = K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, starts)
    assert torch.equal(slots, positions_to_slots_reference(pos, table, row_to_req, seq_lens, P))


def test_twenty_runs_bitwise_equal():
    r, width, k = 64, 131072, 2048
    logits, lengths, starts = _rows(r, width, k, seed=7)
    table, row_to_req, seq_lens = _slots_inputs(r, width, seed=7)
    first = K.topk_indices(logits, lengths, k, starts)
    first_slots = K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, starts)
    for _ in range(19):
        assert torch.equal(K.topk_indices(logits, lengths, k, starts), first)
        assert torch.equal(K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, starts), first_slots)


def test_cuda_graph_capture_and_replay():
    r, width, k = 16, 65536, 2048
    logits, lengths, starts = _rows(r, width, k, seed=9)
    table, row_to_req, seq_lens = _slots_inputs(r, width, seed=9)
    run = lambda: K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, starts)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (10, 11):
        fresh, fresh_len, fresh_start = _rows(r, width, k, seed=seed)
        logits.copy_(fresh)
        lengths.copy_(fresh_len)
        starts.copy_(fresh_start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
        pos = K.topk_indices(logits, lengths, k, starts)
        check_topk(pos, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
        assert torch.equal(out, positions_to_slots_reference(pos, table, row_to_req, seq_lens, P))


@pytest.mark.parametrize("k", [1, 64, 2048, 4096], ids=lambda k: f"k{k}")
def test_any_k(k):
    logits, lengths, starts = _rows(32, 65536, k, seed=k)
    out = K.topk_indices(logits, lengths, k, starts)
    check_topk(out, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))


def test_rows_built_against_the_sample():
    """The guess fails (the sampled columns hold the row's largest values), the k-th value lies far
    above the sampled band, every column ties, the row ascends: each path stays exact."""
    g = torch.Generator().manual_seed(3)
    width, k = 65536, 2048
    sampled = _sampled_columns(width, SAMPLE)
    bait = torch.randn(width, generator=g)
    bait[sampled] = 100 + torch.arange(len(sampled)).float()
    far = 1 + torch.rand(width, generator=g) * 0.1
    free = torch.ones(width, dtype=torch.bool)
    free[sampled] = False
    far[free.nonzero().flatten()[torch.randperm(int(free.sum()), generator=g)[:3000]]] = 1e6 + torch.arange(3000.0)
    logits = torch.stack((bait, far, torch.full((width,), 3.0), torch.arange(width).float())).cuda()
    lengths = torch.full((4,), width, dtype=torch.int32, device="cuda")
    scratch = {}
    out = topk_triton(logits, lengths, k, None, scratch=scratch)
    check_topk(out, logits, lengths, k, ref=topk_indices_reference(logits, lengths, k))
    hist = scratch["hist"].sum(1).cpu()  # [4, 256] the rows' histograms
    assert hist[0].sum() < k, "the baited row must fail the guess"
    assert (hist[1].sum() - hist[1].cumsum(0) + hist[1] >= k).sum() - 1 == 255, "the far row must reach the top bin"


@pytest.mark.parametrize("r,width,kernels", [
    (64, 65536, ["_finish_kernel", "_place_kernel", "_scan_kernel"]),
    (32, 1 << 20, ["_bound_kernel", "_finish_kernel", "_place_kernel", "_scan_tiles_kernel", "_tile_max_kernel"])],
    ids=["guess-64x64K", "tile-bound-32x1M"])
def test_launches(r, width, kernels):
    """The sampled guess: scan, place, finish; the tile bound: tile maxima, bound, scan of the listed
    tiles, place, finish. No memset, nothing else."""
    logits, lengths, starts = _rows(r, width, 2048, seed=1)
    op = lambda: K.topk_indices(logits, lengths, 2048, starts)  # noqa: E731
    op()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        op()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [n for n in names if "memset" in n.lower() or "fill" in n.lower()] == [], names
    assert sorted(n for n in names) == kernels, names


@pytest.mark.parametrize("width", [1 << 19, (1 << 20) + 4099], ids=["512K", "1M-odd"])
def test_tile_bound_equals_the_guess_on_prefill_windows(width):
    """64 prefill rows of one chunk (causal windows ending at consecutive positions, as the ragged
    logits give them, -inf past each end), as positions and slots: the tile bound's selections
    equal the sampled guess's and the reference's, and graph replay gives them again."""
    g = torch.Generator(device="cuda").manual_seed(width)
    r, k = 64, 2048
    logits = torch.randn(r, width, device="cuda", generator=g)
    ends = torch.arange(width - r + 1, width + 1, dtype=torch.int32, device="cuda")
    logits[torch.arange(width, device="cuda")[None, :] >= ends[:, None]] = float("-inf")
    logits[::5] = (logits[::5] * 8).round()  # ties at the threshold
    starts = torch.zeros(r, dtype=torch.int32, device="cuda")
    starts[1::7] = 1000
    lengths = ends - starts
    table, row_to_req, seq_lens = _slots_inputs(r, width, seed=width)
    guessed = topk_triton(logits, lengths, k, starts, bound_tiles=1 << 30)
    bounded = topk_triton(logits, lengths, k, starts)
    check_topk(bounded, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
    assert torch.equal(bounded.sort(1).values, guessed.sort(1).values)
    run = lambda: K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, starts)  # noqa: E731
    slots = run()
    assert torch.equal(slots, positions_to_slots_reference(bounded, table, row_to_req, seq_lens, P))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    logits[3:9] = logits[3:9].flip(1)  # new values, the same windows
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
