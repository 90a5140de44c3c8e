"""Streamed prefill indexer top-k (``indexer_topk_ragged``) under the CPU interpreter, at small odd shapes.

The streamed result must equal the chunked path, ``indexer_logits_ragged`` then ``topk_indices`` /
``topk_slots`` (both Triton), bit for bit: the same positions in the same order. Inputs: causal tails,
windows of 0, 1, k - 1, k, k + 1 keys and past ``S``, keys repeated to make ties at the threshold far
beyond a region (``CAP``), NaN and inf logits, logits increasing along the row (every key enters its
region: the worst case for the regions' compaction), rows below the sample size; outputs poisoned,
the workspace filled with garbage, default key splits and one split. The GPU twin is
``test_indexer_topk_kernels_gpu.py``.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.indexer_topk_ragged import (
    _indexer_topk_ragged_triton,
    default_cap,
    indexer_topk_ragged_reference,
)
from dsa.kernels.topk.launch import topk_triton
from dsa.testing import random_block_tables

POISON = -7  # never a valid output: every element must be written
FP8 = torch.float8_e4m3fn


def make_inputs(t, hi, s, kind, seed=0):
    """``(q8, weights, k8, k_scale)`` of ``t`` tokens with ``hi`` heads against ``s`` keys of one kind."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hi, 128, generator=g)
    k = torch.randn(s, 128, generator=g)
    w = torch.randn(t, hi, generator=g)
    k_scale = torch.rand(s, generator=g) + 0.5
    if kind == "ties":  # five distinct keys: each row holds five logits, ties far beyond k and CAP
        k = k[torch.randint(0, 5, (s,), generator=g)]
        k_scale = torch.ones(s)
    elif kind == "nan":
        k_scale.view(torch.int32)[::7] = 0x7FFFFFFF  # the GPU's NaN: the top key, more than k of them
        k_scale[3::11] = float("inf")
        w[1] = float("nan")  # a row of NaN
        w[2, 0] = float("-inf")  # -inf or NaN (0 * -inf) wherever head 0 scores
        q[3] = 0.0  # a row of zeros: all tied
    elif kind == "increasing":  # positive scores growing with the column: every key enters its region
        q, k, w = q.abs(), k.abs(), w.abs()
        k_scale = torch.linspace(0.5, 8.0, s)
    return q.to(FP8), w, k.to(FP8), k_scale


def make_ranges(t, s, k, kind, seed=0):
    """``(starts, ends)`` int32: a causal tail, or windows of every size class (0, 1, k - 1, k, k + 1,
    below and above the sample size, the whole row) with starts > 0, < 0 and ends past ``S``."""
    if kind == "causal":
        return torch.zeros(t, dtype=torch.int32), torch.arange(s - t + 1, s + 1, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([0, 1, k - 1, k, k + 1, 300, 511, 512, 513, s, s - 3, s + 9])[:t]
    lens = torch.cat((lens, torch.randint(0, s + 1, (t - len(lens),), generator=g)))
    starts = torch.randint(0, s // 3, (t,), generator=g)
    starts[::4] = 0
    starts[1::5] = -3
    return starts.int(), (starts + lens).int()


def chunked(q8, w, k8, k_scale, starts, ends, k, slots=None):
    """The chunked path: ragged logits, then the Triton top-k over each row's window."""
    logits = K.indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="triton")
    s0 = starts.clamp_min(0)
    n = (ends.clamp_max(k8.shape[0]) - s0).clamp_min(0).int()
    return topk_triton(logits, n, k, s0.int(), slots)


def streamed(*args, **knobs):
    t, k = args[0].shape[0], args[6]
    out = torch.full((t, k), POISON, dtype=torch.int32)
    return _indexer_topk_ragged_triton(*args, out=out, fill=-1, **knobs)


def assert_same(got, want, what):
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{what}: rows {bad[:8]} differ from the chunked path (first: {got[bad[0]][:12].tolist()} vs " \
                    f"{want[bad[0]][:12].tolist()})"


CASES = [  # (kind of inputs, kind of ranges, T, HI, S, k)
    ("random", "causal", 5, 5, 601, 50),
    ("ties", "causal", 4, 3, 700, 64),
    ("nan", "windows", 14, 4, 650, 40),
    ("increasing", "causal", 2, 2, 1100, 16),
    ("random", "windows", 12, 64, 389, 33),
]


@pytest.mark.parametrize("inputs,ranges,t,hi,s,k", CASES, ids=[f"{c[0]}-{c[1]}-T{c[2]}-HI{c[3]}-S{c[4]}-k{c[5]}"
                                                               for c in CASES])
def test_streamed_equals_the_chunked_path(inputs, ranges, t, hi, s, k):
    q8, w, k8, k_scale = make_inputs(t, hi, s, inputs, seed=s)
    starts, ends = make_ranges(t, s, k, ranges, seed=t)
    args = (q8, w, k8, k_scale, starts, ends, k)
    want = chunked(*args)
    scratch = {}
    assert_same(streamed(*args, scratch=scratch), want, "default splits")
    if scratch:
        assert scratch["splits"] > 1
    n = (ends.clamp_max(s) - starts.clamp_min(0)).clamp_min(0)
    if int(n.max()) > default_cap(k):  # one split: rows of more than CAP keys overflow their region
        one = {}
        assert_same(streamed(*args, splits=1, scratch=one), want, "one split")
        over = n > one["cap"]
        assert bool((one["counts"][over, 0] < n[over]).all()), "a region of more than CAP keys kept them all"
    ref = indexer_topk_ragged_reference(*args)
    assert torch.equal(want.sort(dim=1).values, ref.sort(dim=1).values), "the chunked path is not the reference's set"


def test_slots_of_several_requests_equal_the_chunked_path():
    """Rows of three requests (block tables of their own) written as slots, positions outside the
    request's table -1, as ``topk_slots``."""
    t, hi, s, k, p = 9, 3, 520, 24, 16
    q8, w, k8, k_scale = make_inputs(t, hi, s, "random", seed=5)
    starts, ends = make_ranges(t, s, k, "windows", seed=5)
    table, _ = random_block_tables([s, s // 2, 40], p, generator=torch.Generator().manual_seed(3))
    row_to_req = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1, 5], dtype=torch.int32)  # 5: no request
    seq_lens = torch.tensor([s, s // 2, 40], dtype=torch.int32)
    slots = (table, row_to_req, seq_lens, p)
    args = (q8, w, k8, k_scale, starts, ends, k)
    want = chunked(*args, slots)
    assert_same(streamed(*args, slots), want, "slots")
    got = K.indexer_topk_ragged(*args, block_table=table, row_to_req=row_to_req, seq_lens=seq_lens, block_size=p,
                                backend="triton")
    assert_same(got, want, "public op")
    ref = K.indexer_topk_ragged(*args, block_table=table, row_to_req=row_to_req, seq_lens=seq_lens, block_size=p,
                                backend="torch")
    assert torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values)


def test_a_row_does_not_depend_on_the_batch():
    """Each row alone (one token, its own splits) equals the row in the batch, and in a batch of
    other rows in another order."""
    t, hi, s, k = 6, 4, 560, 20
    q8, w, k8, k_scale = make_inputs(t, hi, s, "ties", seed=9)
    starts, ends = make_ranges(t, s, k, "causal")
    batch = streamed(q8, w, k8, k_scale, starts, ends, k)
    perm = torch.tensor([4, 1, 5, 0, 3, 2])
    shuffled = streamed(q8[perm], w[perm], k8, k_scale, starts[perm], ends[perm], k, splits=2)
    assert_same(shuffled, batch[perm], "shuffled batch")
    for r in (0, 5):
        alone = streamed(q8[r:r + 1], w[r:r + 1], k8, k_scale, starts[r:r + 1], ends[r:r + 1], k)
        assert_same(alone, batch[r:r + 1], f"row {r} alone")


@pytest.mark.parametrize("s,k", [(0, 8), (30, 64), (64, 64)], ids=["S0", "S-below-k", "S-equal-k"])
def test_rows_of_at_most_k_keys_are_dense(s, k):
    q8, w, k8, k_scale = make_inputs(5, 2, s, "random")
    starts = torch.tensor([0, 3, -2, 10, 0], dtype=torch.int32)
    ends = torch.tensor([s, s, 5, 4, 0], dtype=torch.int32)
    got = streamed(q8, w, k8, k_scale, starts, ends, k)
    assert_same(got, chunked(q8, w, k8, k_scale, starts, ends, k), "dense rows")
    assert streamed(q8[:0], w[:0], k8, k_scale, starts[:0], ends[:0], k).shape == (0, k)


def test_public_op_checks_its_arguments():
    q8, w, k8, k_scale = make_inputs(2, 2, 10, "random")
    z = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="q8"):
        K.indexer_topk_ragged(q8.float(), w, k8, k_scale, z, z, 4)
    with pytest.raises(ValueError, match="k"):
        K.indexer_topk_ragged(q8, w, k8, k_scale, z, z, 0)
    with pytest.raises(ValueError, match="all four"):
        K.indexer_topk_ragged(q8, w, k8, k_scale, z, z, 4, block_size=16)
    with pytest.raises(ValueError, match="cap"):
        _indexer_topk_ragged_triton(q8, w, k8, k_scale, z, z, 4, cap=100)


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_model_prefill_routes_fp8_rows_to_the_stream(precision, monkeypatch):
    """A tiny model's prefill: FP8 sparse rows go to ``indexer_topk_ragged`` (its Triton kernels give the
    chunked path's slots for the model's own arguments), exact ones to ragged logits then ``topk_slots``."""
    import dsa.indexer.lightning as lightning
    from tests.model_utils import prompt, tiny_model

    calls = {"stream": 0, "chunked": 0}
    real_stream, real_logits = lightning.indexer_topk_ragged, lightning.indexer_logits_ragged

    def stream(q8, w, keys, k_scale, starts, ends, k, **table):
        calls["stream"] += 1
        got = real_stream(q8, w, keys, k_scale, starts, ends, k, **table, backend="triton")
        slots = (table["block_table"], table["row_to_req"], table["seq_lens"], table["block_size"])
        assert_same(got, chunked(q8, w, keys, k_scale, starts, ends, k, slots), "model rows")
        return got

    def logits(*args, **kw):
        calls["chunked"] += 1
        return real_logits(*args, **kw)

    monkeypatch.setattr(lightning, "indexer_topk_ragged", stream)
    monkeypatch.setattr(lightning, "indexer_logits_ragged", logits)
    model = tiny_model(indexer_precision=precision, n_routed_experts=None)
    model(torch.tensor([prompt(21, 1)]))
    assert calls == ({"stream": 2, "chunked": 0} if precision == "fp8" else {"stream": 0, "chunked": 2}), calls
