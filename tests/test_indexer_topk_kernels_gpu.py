"""Streamed prefill indexer top-k on a CUDA GPU at production shapes (marker ``gpu``): HI = 64, DI = 128,
k = 2048, 64K and 1M keys.

``indexer_topk_ragged`` equals the chunked path (``indexer_logits_ragged`` then ``topk_indices`` /
``topk_slots``) bit for bit, positions and order: causal tails, windows of 0, 1, k - 1, k, k + 1 keys,
repeated keys (ties far beyond a region), NaN / inf logits, logits growing along the row (every key
enters its region: compaction every k appends), many token tiles (one key split) and few (many);
the launcher's knobs (TMA, stages, splits, region size) change nothing; 5 runs and a CUDA-graph
replay are bitwise equal.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.indexer_topk_ragged import _indexer_topk_ragged_triton
from dsa.testing import random_block_tables
from test_indexer_topk_kernels import assert_same, chunked, make_inputs, make_ranges

pytestmark = pytest.mark.gpu
HI, K_TOP, P = 64, 2048, 64


def _cuda(*xs):
    return [x.cuda() for x in xs]


CASES = [  # (kind of inputs, kind of ranges, T, S)
    ("random", "causal", 64, 65536),
    ("ties", "causal", 48, 65536),
    ("nan", "windows", 40, 65536),
    ("increasing", "causal", 16, 65536),
    ("random", "windows", 300, 9000),
    ("random", "causal", 1024, 16384),
    ("random", "causal", 8, 1 << 20),
    ("increasing", "causal", 4, 1 << 20),
]


@pytest.mark.parametrize("inputs,ranges,t,s", CASES, ids=[f"{c[0]}-{c[1]}-T{c[2]}-S{c[3]}" for c in CASES])
def test_streamed_equals_the_chunked_path(inputs, ranges, t, s):
    q8, w, k8, k_scale = _cuda(*make_inputs(t, HI, s, inputs, seed=t))
    starts, ends = _cuda(*make_ranges(t, s, K_TOP, ranges, seed=s))
    args = (q8, w, k8, k_scale, starts, ends, K_TOP)
    want = chunked(*args)
    out = torch.full((t, K_TOP), -7, dtype=torch.int32, device="cuda")
    assert_same(_indexer_topk_ragged_triton(*args, out=out, fill=-1), want, "positions")
    assert_same(K.indexer_topk_ragged(*args), want, "public op")


def test_slots_equal_the_chunked_path():
    t, s = 64, 65536
    q8, w, k8, k_scale = _cuda(*make_inputs(t, HI, s, "random", seed=3))
    starts, ends = _cuda(*make_ranges(t, s, K_TOP, "causal"))
    table, _ = random_block_tables([s, s // 2], P, generator=torch.Generator().manual_seed(1))
    row_to_req = (torch.arange(t, dtype=torch.int32) % 2).cuda()
    seq_lens = torch.tensor([s, s // 2], dtype=torch.int32, device="cuda")
    slots = (table.cuda(), row_to_req, seq_lens, P)
    args = (q8, w, k8, k_scale, starts, ends, K_TOP)
    got = K.indexer_topk_ragged(*args, block_table=slots[0], row_to_req=row_to_req, seq_lens=seq_lens, block_size=P)
    assert_same(got, chunked(*args, slots), "slots")


KNOBS = [dict(tma=True), dict(stages=4), dict(tma=True, stages=4), dict(splits=1), dict(splits=16),
         dict(cap=K_TOP + 64), dict(cap=4 * K_TOP), dict(waves=4), dict(maxnreg=128)]


def test_knobs_runs_and_graph_replay_change_nothing():
    t, s = 96, 65536
    q8, w, k8, k_scale = _cuda(*make_inputs(t, HI, s, "ties", seed=5))
    starts, ends = _cuda(*make_ranges(t, s, K_TOP, "causal"))
    args = (q8, w, k8, k_scale, starts, ends, K_TOP)
    default = _indexer_topk_ragged_triton(*args)
    assert_same(default, chunked(*args), "default")
    for kw in KNOBS:
        assert_same(_indexer_topk_ragged_triton(*args, **kw), default, str(kw))
    for i in range(5):
        assert_same(_indexer_topk_ragged_triton(*args), default, f"run {i}")
    out = torch.empty_like(default)
    graph = torch.cuda.CUDAGraph()
    _indexer_topk_ragged_triton(*args, out=out)  # compiled before the capture
    with torch.cuda.graph(graph):
        _indexer_topk_ragged_triton(*args, out=out)
    out.fill_(-7)
    graph.replay()
    assert_same(out, default, "graph replay")
