"""indexer_topk_paged (paged logits + top-k, fused) under the CPU interpreter, at small odd shapes.

The fused op is the unfused pair ``topk_slots(indexer_logits_paged(...))``: the same slot set per
row (the tie rule fixes it), and for rows of at most k positions the same slots in order. Checked
against the torch reference pair, and against the Triton pair where the cache holds NaN/inf (the
Triton logits take ``relu(NaN) = 0`` where torch keeps NaN). Every ``torch.empty`` the op makes is
poisoned first (NaN or -7), so an output slot or a scratch entry read before it is written fails.
The GPU twin of this file is ``test_indexer_topk_paged_gpu.py``.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.common import TRITON_INTERPRET
from dsa.kernels.layouts import indexer_cache_views
from dsa.kernels.indexer_topk_paged import _indexer_topk_paged_triton
from dsa.testing import random_block_tables
from test_indexer_kernels import _random_cache
from test_topk_kernels import _sampled_columns

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not TRITON_INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
P = 16


@pytest.fixture
def poisoned_empty(monkeypatch):
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7) if out.element_size() >= 2 else out

    monkeypatch.setattr(torch, "empty", poisoned)


def unfused(q8, w, cache, table, seq_lens, k, width, backend, p=P):
    """``topk_slots`` of ``indexer_logits_paged``, each row over its causal window."""
    b, n = q8.shape[:2]
    logits = K.indexer_logits_paged(q8, w, cache, table, seq_lens, p, width, backend=backend)
    j = torch.arange(n, device=q8.device)
    lengths = (seq_lens.long()[:, None] - n + 1 + j).clamp(0, logits.shape[1]).view(-1).to(torch.int32)
    row_to_req = torch.arange(b, dtype=torch.int32, device=q8.device).repeat_interleave(n)
    return K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, p, backend=backend), lengths


def assert_same_slots(out, ref, lengths, k):
    """Rows of at most k positions: the same slots in order; longer rows: the same set."""
    assert out.shape == ref.shape and out.dtype == torch.int32
    dense = lengths.long() <= k
    assert torch.equal(out[dense], ref[dense]), "a window of at most k positions must be all of it, in order"
    bad = (out[~dense].sort(1).values != ref[~dense].sort(1).values).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:8]} (of the long ones) select other slots than the unfused pair"


def _inputs(lens, n, hi, gen, table_width=None, kind="random"):
    table, nb = random_block_tables(lens, P, generator=gen, extra_blocks=3)
    if table_width is not None:
        table = table[:, :table_width].contiguous()
    cache = _random_cache(nb, P, gen)
    k8, scale = indexer_cache_views(cache, P)
    if kind == "tied":  # one key record everywhere: every position of a row scores the same
        k8.copy_(k8[0, 0].expand_as(k8))
        scale.fill_(1.0)
    elif kind == "few_values":  # four key records: four logits per row, ties far past k
        pick = torch.randint(0, 4, (nb, P), generator=gen)
        k8.view(torch.uint8).copy_(k8.view(torch.uint8).reshape(-1, 128)[pick.view(-1)].view(nb, P, 128))
        scale.fill_(0.5)
    elif kind == "nan_inf":
        for value, share in ((float("inf"), 10), (float("nan"), 20)):
            hit = torch.randperm(nb * P, generator=gen)[:nb * P // share]
            scale[hit // P, hit % P] = value
        bad = torch.randperm(nb * P, generator=gen)[:nb * P // 20]
        k8.view(torch.uint8)[bad // P, bad % P, :3] = 0xFF
    q8 = torch.randn(len(lens), n, hi, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(len(lens), n, hi, generator=gen)
    if kind == "nan_inf":
        w[0, 0, 0] = float("inf")
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [x.to(DEVICE) for x in (q8, w, cache, table, seq_lens)]


CASES = [  # (seq_lens, N, HI, k, block table width or None, max_seq_len or None, kind)
    ([700, 333, 129], 1, 5, 40, None, None, "random"),
    ([700, 41, 40, 39, 1], 1, 5, 40, None, 700, "random"),  # windows of k + 1, k, k - 1 and 1 positions
    ([513, 260], 2, 64, 33, None, 530, "random"),  # N = 2: two rows of a request, one position apart
    ([400, 90, 1], 2, 7, 32, None, None, "random"),  # S = 1 < N: an empty window
    ([600, 300], 1, 5, 40, 20, 640, "random"),  # past the block table: -inf positions inside the window
    ([650, 200], 1, 5, 40, None, None, "tied"),
    ([650, 200], 2, 5, 24, None, None, "few_values"),
]


@pytest.mark.parametrize("lens,n,hi,k,table_width,width,kind", CASES,
                         ids=[f"S{'-'.join(map(str, c[0]))}-N{c[1]}-HI{c[2]}-k{c[3]}-MB{c[4]}-W{c[5]}-{c[6]}"
                              for c in CASES])
def test_fused_equals_the_unfused_pair(lens, n, hi, k, table_width, width, kind, poisoned_empty):
    gen = torch.Generator().manual_seed(len(lens) * 100 + n * 10 + k)
    q8, w, cache, table, seq_lens = _inputs(lens, n, hi, gen, table_width, kind)
    out = K.indexer_topk_paged(q8, w, cache, table, seq_lens, P, k, width, backend="triton")
    ref, lengths = unfused(q8, w, cache, table, seq_lens, k, width, "torch")
    assert_same_slots(out, ref, lengths, k)
    assert torch.equal(K.indexer_topk_paged(q8, w, cache, table, seq_lens, P, k, width, backend="torch"), ref)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf * 0
def test_nan_and_inf_logits_select_as_the_triton_pair(poisoned_empty):
    gen = torch.Generator().manual_seed(5)
    k, width = 40, 600
    q8, w, cache, table, seq_lens = _inputs([600, 500, 420], 1, 5, gen, kind="nan_inf")
    out = K.indexer_topk_paged(q8, w, cache, table, seq_lens, P, k, width, backend="triton")
    ref, lengths = unfused(q8, w, cache, table, seq_lens, k, width, "triton")
    assert_same_slots(out, ref, lengths, k)


def test_a_window_built_against_the_sample_is_scored_again():
    """Keys at the sampled positions score far above the rest, so fewer than k positions reach the
    guess: the finish kernel scores the whole window again; the set is still the unfused pair's."""
    gen = torch.Generator().manual_seed(9)
    s, k, sample = 640, 48, 32
    q8, w, cache, table, seq_lens = _inputs([s], 1, 4, gen)
    w.abs_()
    k8, scale = indexer_cache_views(cache, P)
    sampled = _sampled_columns(s, sample)
    slots = table[0].long()[sampled // P] * P + sampled % P
    k8.view(torch.uint8)[slots // P, slots % P] = q8[0, 0, 0].view(torch.uint8)  # head 0's query: large logits
    scale[slots // P, slots % P] = 64.0
    scratch = {}
    out = _indexer_topk_paged_triton(q8, w, cache, table, seq_lens, P, k, None, sample=sample, scratch=scratch)
    ref, lengths = unfused(q8, w, cache, table, seq_lens, k, None, "torch")
    assert scratch["hist"].sum() < k, "the guess must fail"
    assert_same_slots(out, ref, lengths, k)


def test_block_ids_outside_the_cache_score_minus_inf():
    """A block id outside [0, NB) reads nothing: its positions score -inf (ranked last, lowest
    positions first) and map to no slot."""
    gen = torch.Generator().manual_seed(13)
    k = 40
    q8, w, cache, table, seq_lens = _inputs([500, 300], 1, 5, gen)
    nb = cache.shape[0]
    table[0, 3], table[0, 7], table[1, 2] = -5, nb, nb + 1000
    out = K.indexer_topk_paged(q8, w, cache, table, seq_lens, P, k, backend="triton")
    safe = table.clamp(0, nb - 1)  # the same scores elsewhere; then the bad blocks' positions at -inf
    logits = K.indexer_logits_paged(q8, w, cache, safe, seq_lens, P, backend="torch")
    bad = ((table < 0) | (table >= nb)).repeat_interleave(P, dim=1)[:, :logits.shape[1]]
    logits[bad] = float("-inf")
    ref = K.topk_slots(logits, seq_lens, k, table, torch.arange(2, dtype=torch.int32), seq_lens, P, backend="torch")
    assert_same_slots(out, ref, seq_lens, k)


def test_fused_refuses_bad_arguments():
    q8 = torch.zeros(1, 1, 4, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    args = (q8, torch.zeros(1, 1, 4, device=DEVICE), torch.zeros(2, P * 132, dtype=torch.uint8, device=DEVICE),
            torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE), P)
    with pytest.raises(ValueError, match="^k"):
        K.indexer_topk_paged(*args, 0)
    with pytest.raises(ValueError, match="^max_seq_len"):
        K.indexer_topk_paged(*args, 8, -1)
    with pytest.raises(TypeError, match="^weights"):
        K.indexer_topk_paged(q8, torch.zeros(1, 1, 4, dtype=torch.float64, device=DEVICE), *args[2:], 8)


def test_fused_logits_are_the_paged_logits():
    """The logits the fused kernel scores (stored by its test hook) are ``indexer_logits_paged``'s."""
    gen = torch.Generator().manual_seed(17)
    q8, w, cache, table, seq_lens = _inputs([700, 333], 2, 7, gen, table_width=40)
    width = 720
    logits = torch.full((4, width), float("-inf"), device=DEVICE)
    _indexer_topk_paged_triton(q8, w, cache, table, seq_lens, P, 40, width, logits=logits)
    assert torch.equal(logits, K.indexer_logits_paged(q8, w, cache, table, seq_lens, P, width, backend="triton"))
