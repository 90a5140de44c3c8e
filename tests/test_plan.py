"""BatchPlan: routing (which path serves which rows, decided once in a Route), the facts every layer
reads, padding to a graph bucket, and the dispatch thresholds."""
import json
from dataclasses import astuple

import numpy as np
import pytest
import torch

from dsa import BatchPlan, DSAConfig, DSAModel
from dsa.kernels import positions_to_slots
from dsa.model.dispatch import Dispatch, load_dispatch
from dsa.model.plan import Bucket, HostPlan, PlanOptions
from dsa.model.route import PATHS, graph_bucket
from kernel_utils import owned_slots, poison_unowned_rows

P = 16
MHA_FROM_3 = Dispatch(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128, prefill_mha_min_query=3)


def _tables(n, per=8):
    return [list(range(i * per + 3, i * per + 3 + per))[::-1] for i in range(n)]  # non-contiguous blocks


def _plan(query_lens, context_lens, k=16, dispatch=None, kv_bytes=0, **kw):
    return BatchPlan.build(query_lens, context_lens, _tables(len(query_lens)), P, "cpu",
                           options=PlanOptions(index_topk=k, dispatch=dispatch, mha_kv_bytes_per_token=kv_bytes), **kw)


def test_rows_split_by_valid_range():
    # decode with S=16 (fits: its top-k is every position), with S=17, a prefill chunk straddling index_topk
    plan = _plan([1, 1, 10], [15, 16, 10])
    rows = plan.route.rows
    assert rows["sparse_decode"] == 2 and rows["dense_decode"] == 0  # both run top-k + sparse
    # chunk positions 10..19: 10..15 have ranges <= 16 (dense), 16..19 sparse
    assert rows["dense_prefill_absorbed"] == 6 and rows["sparse_prefill"] == 4
    assert plan.positions.tolist() == [15, 16] + list(range(10, 20))
    assert plan.seq_lens.tolist() == [16, 17, 20] and plan.max_seq_len == 20
    assert plan.logits_rows.tolist() == [0, 1, 11]
    assert plan.decode.rows == slice(0, 2) and plan.decode.max_seq_len == 20
    assert plan.indexer.decode is plan.decode and plan.indexer.every_position is None  # S=20 > 16: scored
    assert not plan.route.decode_only and not plan.route.every_position
    seg, = plan.absorbed
    assert (seg.req, seg.row0, seg.row1, seg.pos0, seg.num_keys) == (2, 2, 8, 10, 16)
    assert seg.seq_len.tolist() == [16]  # the segment's own context, not the request's
    pre, = plan.indexer.prefill
    assert pre.rows == slice(8, 12) and pre.valid_lens.tolist() == [17, 18, 19, 20] and pre.seq_len.tolist() == [20]
    assert (pre.pos0, pre.num_keys) == (16, 20)  # host sizes: the indexer gathers 20 keys without a sync
    assert plan.sparse_prefill_rows.tolist() == [8, 9, 10, 11]
    assert plan.indexer.zeros.tolist() == [0] * 12


def test_slots_come_from_positions_to_slots():
    plan = _plan([1, 3, 1], [20, 5, 40])
    tables = torch.tensor(_tables(3), dtype=torch.int32)
    want = positions_to_slots(plan.positions[:, None], tables, plan.row_to_req, plan.seq_lens, P)[:, 0]
    assert torch.equal(plan.slot_mapping, want)
    assert plan.slot_mapping.tolist()[0] == tables[0, 20 // P] * P + 20 % P
    # decode rows 0 and 4 are not contiguous: gathered per row, each row reads its own request's table
    assert not plan.route.contiguous
    assert plan.decode.rows.tolist() == [0, 4] and torch.equal(plan.decode.block_table, tables[[0, 2]])
    assert plan.decode.seq_lens.tolist() == [21, 41] and plan.decode.row_ids.tolist() == [0, 1]


def test_short_decode_steps_hand_every_position():
    """A decode-only step whose contexts all fit in index_topk: every position's slot, -1 after S
    (what top-k returns for such rows), so the indexer scores nothing."""
    plan = _plan([1, 1], [4, 9], k=16)
    every = plan.indexer.every_position
    assert plan.route.decode_only and plan.route.every_position and every.shape == (2, 16)
    assert plan.indexer.decode is None and plan.indexer.zeros is None  # nothing to score, no ragged starts
    tables = torch.tensor(_tables(2), dtype=torch.int32)
    for r, s in enumerate([5, 10]):
        assert every[r, :s].tolist() == (tables[r, 0] * P + torch.arange(s)).tolist()
        assert (every[r, s:] == -1).all()


def test_no_indexer_is_all_dense():
    plan = _plan([1, 40], [100, 0], k=None)
    rows = plan.route.rows
    assert rows["sparse_decode"] == rows["sparse_prefill"] == 0
    assert rows["dense_decode"] == 1 and rows["dense_prefill_absorbed"] == 40
    assert not plan.route.sparse_decode and plan.indexer.every_position is None and plan.indexer.prefill == ()


def test_padding_to_a_graph_bucket():
    host = HostPlan.pack([1, 1, 1], [30, 7, 70], _tables(3), P, "cpu", options=PlanOptions(index_topk=16),
                         input_ids=[5, 6, 7], bucket=Bucket(8, 256))
    plan = host.derive(host.upload())
    assert plan.num_tokens == 8 and plan.route.decode_only and plan.max_seq_len == 256
    assert plan.block_table.shape == (8, 16) and plan.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert plan.seq_lens.tolist() == [31, 8, 71, 0, 0, 0, 0, 0]  # padding rows see nothing
    assert (plan.slot_mapping[3:] == -1).all() and (plan.slot_mapping[:3] >= 0).all()  # ... and write nowhere
    assert plan.route.rows["sparse_decode"] == 3 and plan.route.rows["dense_decode"] == 0  # real rows only
    again = HostPlan.pack([1], [3], _tables(1), P, "cpu", options=PlanOptions(index_topk=16), input_ids=[1],
                          bucket=Bucket(8, 256))
    assert again.spec == host.spec  # one bucket, one layout: a captured graph's buffer is refilled in place
    buf = torch.zeros(host.packer.size, dtype=torch.int32)
    assert again.derive(again.upload(buf)).input_ids.data_ptr() == buf.data_ptr() + again.spec["ids"][0] * 4
    with pytest.raises(ValueError, match="bucket"):
        HostPlan.pack([2], [3], _tables(1), P, "cpu", bucket=Bucket(4, 256))
    with pytest.raises(ValueError, match="bucket"):
        HostPlan.pack([1] * 5, [3] * 5, _tables(5), P, "cpu", bucket=Bucket(4, 256))


def test_decode_requests_take_next_n_rows_padded_in_front():
    """next_n = 3: requests of <= 3 new tokens decode, each padded in front to 3 rows at the positions
    before its new ones (seeing only what those see, writing nowhere); a longer one is a prefill chunk."""
    host = HostPlan.pack([3, 1, 20, 2], [30, 7, 10, 50], _tables(4), P, "cpu", options=PlanOptions(index_topk=16),
                         input_ids=np.arange(26) + 100, next_n=3, logits_rows=[0, 1, 2, 3, 23, 24, 25])
    plan = host.derive(host.upload())
    assert host.query_lens.tolist() == [3, 3, 20, 3] and plan.num_tokens == 29
    assert host.row_index.tolist() == [0, 1, 2, 5] + list(range(6, 26)) + [27, 28]
    assert plan.positions.tolist() == [30, 31, 32, 5, 6, 7] + list(range(10, 30)) + [49, 50, 51]
    assert plan.row_to_req.tolist() == [0, 0, 0, -1, -1, 1] + [2] * 20 + [-1, 3, 3]
    pad = torch.tensor([3, 4, 26])
    assert (plan.slot_mapping[pad] == -1).all() and (plan.slot_mapping[plan.row_to_req >= 0] >= 0).all()
    assert plan.input_ids[pad].tolist() == [0, 0, 0] and plan.input_ids[5].item() == 103
    assert plan.seq_lens.tolist() == [33, 8, 30, 52]  # each request's own tokens
    assert plan.logits_rows.tolist() == [0, 1, 2, 5, 25, 27, 28]  # the rows given, at their plan rows
    d = plan.decode
    assert not plan.route.contiguous and d.next_n == 3 and d.rows.tolist() == [0, 1, 2, 3, 4, 5, 26, 27, 28]
    assert d.row_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and d.seq_lens.tolist() == [33, 8, 52]
    assert d.lengths.tolist() == [31, 32, 33, 6, 7, 8, 50, 51, 52]  # row j of S sees [0, S - 3 + j]
    rows = plan.route.rows
    assert rows["sparse_decode"] == 6 and rows["sparse_prefill"] + rows["dense_prefill_absorbed"] == 20


def test_next_n_rows_hand_each_row_its_own_positions():
    """Contexts within index_topk: every position up to each row's own, -1 after it (a padding row
    before position 0 sees nothing)."""
    plan = BatchPlan.build([2, 1], [4, 0], _tables(2), P, "cpu", options=PlanOptions(index_topk=16), next_n=3)
    every, tables = plan.indexer.every_position, torch.tensor(_tables(2), dtype=torch.int32)
    assert plan.route.decode_only and plan.route.every_position and every.shape == (6, 16)
    assert plan.positions.tolist() == [3, 4, 5, -2, -1, 0] and plan.decode.lengths.tolist() == [4, 5, 6, 0, 0, 1]
    for r, (req, s) in enumerate(zip([0, 0, 0, 1, 1, 1], [4, 5, 6, 0, 0, 1])):
        assert every[r, :s].tolist() == (tables[req, 0] * P + torch.arange(s)).tolist() and (every[r, s:] == -1).all()
    assert plan.slot_mapping.tolist()[3:5] == [-1, -1] and plan.slot_mapping[0].item() == -1  # row 0: padding


def test_a_next_n_bucket_keeps_one_layout():
    """A verify step padded to its Bucket(rows, context, next_n): the padding requests' next_n rows see
    nothing, the logits rows padded to rows * next_n; any step of the bucket packs the same layout."""
    opts = PlanOptions(index_topk=16)
    host = HostPlan.pack([3, 1, 2], [30, 7, 70], _tables(3), P, "cpu", options=opts, input_ids=[1, 2, 3, 4, 5, 6],
                         next_n=3, graphs=True, logits_rows=[0, 1, 2, 3, 3, 3])
    assert host.bucket == Bucket(4, 256, 3) and host.bucket != Bucket(4, 256)
    plan = host.derive(host.upload())
    assert plan.num_tokens == 12 and plan.route.decode_only and plan.route.rows["sparse_decode"] == 6
    assert plan.seq_lens.tolist() == [33, 8, 72, 0] and (plan.slot_mapping[9:] == -1).all()
    assert plan.logits_rows.tolist() == [0, 1, 2, 5, 5, 5] + [0] * 6
    empty = HostPlan.pack([], [], np.zeros((0, 16), np.int32), P, "cpu", options=opts, input_ids=np.zeros(0, np.int32),
                          bucket=Bucket(4, 256, 3), next_n=3)  # the warm-up's capture plan
    assert empty.spec == host.spec and HostPlan.pack([1], [3], _tables(1), P, "cpu", options=opts, input_ids=[1],
                                                     next_n=3, bucket=Bucket(4, 256, 3)).spec == host.spec


@pytest.mark.parametrize("query_lens,context_lens,want", [
    ([1, 1, 1], [30, 7, 70], Bucket(4, 256)),
    ([1], [255], Bucket(1, 256)),
    ([1], [256], Bucket(1, 512)),  # S = 257
    ([1] * 5, [5000] * 5, Bucket(8, 8192)),  # past 4096: multiples of 4096
    ([1] * 128, [0] * 128, Bucket(128, 256)),
    ([1] * 129, [0] * 129, None),  # more rows than the largest bucket: eager
    ([1, 2], [3, 3], None),  # a prefill row: eager
    ([], [], None),
], ids=["three", "S256", "S257", "S5001", "128rows", "129rows", "mixed", "empty"])
def test_the_plan_picks_the_graph_bucket(query_lens, context_lens, want):
    n = len(query_lens)
    host = HostPlan.pack(query_lens, context_lens, np.zeros((n, 400), np.int32), P, "cpu",
                         options=PlanOptions(index_topk=16), input_ids=np.zeros(sum(query_lens), np.int32), graphs=True)
    assert host.bucket == want, (host.bucket, want)
    assert graph_bucket(np.asarray(query_lens), max([q + c for q, c in zip(query_lens, context_lens)], default=0),
                        P) == want
    if want is not None:
        assert host.max_seq_len == want.max_seq_len and len(host.query_lens) == want.rows
        assert host.route.decode_only and host.route.rows["sparse_decode"] == n
    else:
        assert len(host.query_lens) == n  # no padding
    with pytest.raises(ValueError, match="bucket"):
        HostPlan.pack([1], [3], _tables(1), P, "cpu", bucket=Bucket(1, 256), graphs=True)


# ---- routing: every row on exactly the path a row-by-row rule gives ----------------------------
def _reference_route(query_lens, context_lens, k, dispatch, kv_bytes, padding):
    """Per request, row by row: a request with one new token decodes; a prefill row at position p is
    dense while p + 1 <= k (always without an indexer), else sparse; a request's dense rows are one
    segment, through MHA when the dispatch says so for its rows and keys."""
    rows, decode, sparse, mha, absorbed, sparse_rows, workspace = dict.fromkeys(PATHS, 0), [], [], [], [], [], 0
    first = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if q == 1:
            decode.append(i)
            rows["sparse_decode" if k is not None else "dense_decode"] += 1
        else:
            dense_rows = [first + j for j in range(q) if k is None or c + j + 1 <= k]
            sparse_here = [first + j for j in range(q) if k is not None and c + j + 1 > k]
            if dense_rows:
                n, keys = len(dense_rows), c + len(dense_rows)
                uses_mha = dispatch is not None and dispatch.prefill_uses_mha(n, keys, keys * kv_bytes)
                (mha if uses_mha else absorbed).append((i, dense_rows[0], dense_rows[-1] + 1, c))
                rows["dense_prefill_mha" if uses_mha else "dense_prefill_absorbed"] += n
                workspace = max(workspace, keys * kv_bytes if uses_mha else 0)
            if sparse_here:
                sparse.append((i, sparse_here[0], sparse_here[-1] + 1, c + sparse_here[0] - first))
                rows["sparse_prefill"] += len(sparse_here)
                sparse_rows += sparse_here
        first += q
    decode += list(range(len(query_lens), len(query_lens) + padding))
    return dict(rows=rows, decode_reqs=decode, sparse=sparse, mha=mha, absorbed=absorbed, sparse_rows=sparse_rows,
                workspace_bytes=workspace)


STEPS = [  # (query_lens, context_lens): odd sizes around the index_topk values below
    ([1], [0]), ([1], [6]), ([1], [7]), ([3], [0]), ([17], [0]), ([9], [5]), ([2], [15]),
    ([1, 1, 1], [15, 16, 17]), ([5, 1, 7], [0, 20, 3]), ([1, 17, 1, 2], [3, 0, 40, 14]),
    ([7, 7], [9, 0]), ([1, 1, 13, 1], [2, 30, 6, 0]), ([31], [1]), ([1, 2, 1], [0, 0, 0]),
]
CASES = [(q, c, k, d, pad) for q, c in STEPS for k in (None, 1, 7, 16) for d in (None, MHA_FROM_3)
         for pad in ((0, 3) if all(n == 1 for n in q) else (0,))]


def _case_id(case):
    q, c, k, d, pad = case
    return f"q{'-'.join(map(str, q))}_c{'-'.join(map(str, c))}_k{k}_{'mha3' if d else 'absorbed'}_pad{pad}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_routing_matches_the_row_by_row_rule(case):
    query_lens, context_lens, k, dispatch, padding = case
    kv_bytes = 5
    options = PlanOptions(index_topk=k, dispatch=dispatch, mha_kv_bytes_per_token=kv_bytes)
    longest = max(q + c for q, c in zip(query_lens, context_lens))
    bucket = Bucket(len(query_lens) + padding, 64) if padding else None
    host = HostPlan.pack(query_lens, context_lens, _tables(len(query_lens)), P, "cpu", options=options,
                         input_ids=np.arange(sum(query_lens)), bucket=bucket)
    want = _reference_route(query_lens, context_lens, k, dispatch, kv_bytes, padding)
    r = host.route
    got = dict(rows=r.rows, decode_reqs=r.decode_reqs.tolist(), sparse=[astuple(s) for s in r.sparse],
               mha=[astuple(s) for s in r.mha], absorbed=[astuple(s) for s in r.absorbed],
               sparse_rows=r.sparse_rows.tolist(), workspace_bytes=r.workspace_bytes)
    assert got == want, f"{_case_id(case)}: routed {got}, the row-by-row rule gives {want}"
    num_rows = sum(query_lens) + padding
    max_seq_len = 64 if padding else longest
    assert r.decode_only == (len(want["decode_reqs"]) == len(query_lens) + padding), r
    assert r.every_position == (bool(want["decode_reqs"]) and k is not None and max_seq_len <= k), r
    assert r.sparse_decode == (k is not None)

    # every row is served by exactly one path of the device plan
    plan = host.derive(host.upload())
    served = [] if plan.decode is None else torch.arange(num_rows)[plan.decode.rows].tolist()
    served += [] if plan.sparse_prefill_rows is None else plan.sparse_prefill_rows.tolist()
    served += [row for seg in plan.mha + plan.absorbed for row in range(seg.row0, seg.row1)]
    assert sorted(served) == list(range(num_rows)), f"{_case_id(case)}: rows served {sorted(served)}"
    assert (plan.indexer.decode is None) == (plan.decode is None or r.every_position)
    assert (plan.indexer.every_position is not None) == r.every_position
    assert (plan.indexer.zeros is not None) == bool(r.sparse or r.mha)
    assert [(s.row0, s.row1) for s in plan.indexer.prefill] == [(s.row0, s.row1) for s in r.sparse]
    for seg in plan.mha:  # SDPA's bottom-right causal alignment: row i sees keys 0 .. pos0 + i
        assert seg.num_keys == seg.pos0 + seg.num_rows, seg


# ---- NaN poisoning: a row that no path served, or a read past a request's positions, is NaN ------
@pytest.fixture(scope="module")
def one_layer():
    return DSAModel.random(DSAConfig.tiny(num_hidden_layers=1, index_topk=7, indexer_precision="exact"),
                           dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("query_lens,context_lens,dispatch", [
    ([1, 5, 1, 9], [20, 0, 3, 4], None),  # decode rows scored and every kind of prefill row, absorbed
    ([1, 5, 1, 9], [20, 0, 3, 4], MHA_FROM_3),  # dense rows through MHA, with and without a prefix
    ([11, 1], [2, 6], MHA_FROM_3),
    ([1, 1, 1], [2, 0, 5], None),  # decode only, every position handed over
], ids=["mixed-absorbed", "mixed-mha", "prefix-mha", "every-position"])
def test_every_row_is_served_and_reads_only_its_own_positions(one_layer, query_lens, context_lens, dispatch):
    model, n = one_layer, len(query_lens)
    options = PlanOptions(index_topk=7, dispatch=dispatch, mha_kv_bytes_per_token=0)
    plan = BatchPlan.build(query_lens, context_lens, _tables(n), P, "cpu", options=options,
                           input_ids=torch.arange(sum(query_lens)) % 500)
    caches = model.allocate_caches(8 * n + 3)
    owned = owned_slots(plan.block_table, plan.seq_lens.tolist(), P)
    g = torch.Generator().manual_seed(0)
    for cache in (caches.latent[0].data, caches.index[0].data):
        cache.copy_(torch.randn(cache.shape, generator=g))
        poison_unowned_rows(cache, owned)
    logits = model.step(plan, caches, logits_rows=plan.logits_rows)
    bad = (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()
    assert not bad, f"requests {bad} got non-finite logits (routes {plan.route})"


def test_mha_segments_and_workspace():
    d = Dispatch(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert not d.prefill_uses_mha(100, 100_000, 0)  # Q < ~171: absorbed
    assert d.prefill_uses_mha(400, 100_000, 0)
    assert d.prefill_uses_mha(64, 64, 0)  # a cold prefill: S = Q
    assert not d.prefill_uses_mha(4096, 4096, 1 << 40)  # over the workspace: absorbed, same function
    plan = _plan([40], [0], k=None, dispatch=d, kv_bytes=3)
    seg, = plan.mha
    assert plan.route.rows["dense_prefill_mha"] == 40 and plan.route.workspace_bytes == 40 * 3
    assert seg.slots.tolist() == [plan.block_table[0, p // P].item() * P + p % P for p in range(40)]
    assert seg.pos0 == 0 and seg.num_keys == 40  # no prefix: SDPA's is_causal


def test_thresholds_file_round_trip(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"gpu": "test", "prefill_mha_min_query": 32}))
    d = load_dispatch(DSAConfig.tiny(dispatch_thresholds=str(path)), torch.device("cpu"))
    assert d.source == "t.json" and d.prefill_uses_mha(32, 10_000, 0) and not d.prefill_uses_mha(31, 10, 0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="dispatch_thresholds"):
        load_dispatch(DSAConfig.tiny(dispatch_thresholds=str(tmp_path / "bad.json")), torch.device("cpu"))


@pytest.mark.parametrize("build,match", [
    (lambda: BatchPlan.build([5], [60], [[0, 1]], 16, "cpu"), "block_tables"),
    (lambda: BatchPlan.build([0], [0], [[0]], 16, "cpu"), "query_lens"),
    (lambda: BatchPlan.build([3, 1], [0], [[0], [1]], 16, "cpu"), "context_lens"),
    (lambda: BatchPlan.build([3], [0], [[0]], 16, "cpu", input_ids=[1, 2]), "input_ids"),
    (lambda: HostPlan.pack([2], [0], [[0]], 16, "cpu", input_ids=[1, 2], input_src=[-1]), "input_src"),
    (lambda: HostPlan.pack([1], [20], [[0, 1]], 16, "cpu", bucket=Bucket(1, 16)), "bucket: max_seq_len"),
    (lambda: HostPlan.pack([1], [2], [[0]], 16, "cpu", bucket=(1, 256)), "bucket"),
    (lambda: BatchPlan.build([1], [2], [[0]], 16, "cpu", options={"index_topk": 16}), "options"),
    (lambda: PlanOptions(index_topk=0), "index_topk"),
    (lambda: PlanOptions(index_topk=True), "index_topk"),
    (lambda: PlanOptions(mha_kv_bytes_per_token=-1), "mha_kv_bytes_per_token"),
    (lambda: PlanOptions(dispatch="analytic"), "dispatch"),
    (lambda: HostPlan.pack([1], [2], [[0]], 16, "cpu", next_n=0), "next_n"),
    (lambda: HostPlan.pack([1], [2], [[0]], 16, "cpu", next_n=1.5), "next_n"),
    (lambda: HostPlan.pack([2], [2], [[0]], 16, "cpu", next_n=3, logits_rows=[2]), "logits_rows"),
    (lambda: HostPlan.pack([2], [2], [[0]], 16, "cpu", next_n=3, logits_rows=[[0]]), "logits_rows"),
    (lambda: HostPlan.pack([2], [2], [[0]], 16, "cpu", next_n=3, bucket=Bucket(1, 256)), "bucket: its next_n"),
    (lambda: HostPlan.pack([4], [2], [[0]], 16, "cpu", next_n=3, bucket=Bucket(1, 256, 3)), "bucket: padding"),
], ids=["short-table", "no-new-token", "lengths-differ", "ids", "src", "bucket-too-narrow", "bucket-tuple",
        "options-dict", "topk-0", "topk-bool", "kv-bytes", "dispatch-str", "next_n-0", "next_n-float",
        "logits-row-past-T", "logits-rows-2d", "bucket-next_n", "bucket-prefill-row"])
def test_bad_plans_are_refused(build, match):
    with pytest.raises((ValueError, TypeError), match=f"^{match}"):
        build()


def test_model_reads_the_thresholds_it_is_given(tmp_path):
    path = tmp_path / "dispatch_test.json"
    path.write_text(json.dumps({"prefill_mha_min_query": 8}))
    model = DSAModel.random(DSAConfig.tiny(num_hidden_layers=1, dispatch_thresholds=str(path)), dtype=torch.float32,
                            device="cpu")
    assert model.dispatch.source == "dispatch_test.json" and model.dispatch.prefill_mha_min_query == 8
    assert model.plan_options() == PlanOptions(index_topk=model.config.index_topk, dispatch=model.dispatch,
                                               mha_kv_bytes_per_token=model.plan_options().mha_kv_bytes_per_token)
    assert DSAModel.random(DSAConfig.tiny(num_hidden_layers=1), dtype=torch.float32, device="cpu").dispatch.source \
        == "analytic"  # no file and no GPU: the analytic rule


@pytest.mark.parametrize("query_lens,context_lens", [
    ([5], [2]), ([3, 4], [4, 0]), ([6, 1], [1, 5]),
], ids=["behind-a-prefix", "prefix-and-cold", "prefix-and-decode"])
def test_mha_behind_a_prefix_equals_absorbed(one_layer, query_lens, context_lens):
    """The MHA path's bottom-right causal alignment (``causal_lower_right`` behind a prefix, ``is_causal``
    without) gives the absorbed path's logits: same keys per row, fp32 (every context <= index_topk)."""
    model, n = one_layer, len(query_lens)
    g = torch.Generator().manual_seed(1)
    caches = model.allocate_caches(8 * n + 3)
    for cache in (caches.latent[0].data, caches.index[0].data):
        cache.copy_(torch.randn(cache.shape, generator=g))
    out = {}
    for name, dispatch in (("absorbed", None), ("mha", MHA_FROM_3)):
        options = PlanOptions(index_topk=7, dispatch=dispatch, mha_kv_bytes_per_token=0)
        plan = BatchPlan.build(query_lens, context_lens, _tables(n), P, "cpu", options=options,
                               input_ids=torch.arange(sum(query_lens)) % 500)
        if name == "mha":
            assert plan.route.rows["dense_prefill_mha"] == sum(q for q in query_lens if q >= 3), plan.route
            assert any(seg.pos0 for seg in plan.mha), "no MHA segment behind a prefix"
        copy = model.allocate_caches(8 * n + 3)
        for a, b in zip(copy.latent + copy.index, caches.latent + caches.index):
            a.data.copy_(b.data)
        out[name] = model.step(plan, copy, logits_rows=torch.arange(sum(query_lens)))
    err = (out["mha"] - out["absorbed"]).abs().max().item()
    assert err <= 1e-4 * out["absorbed"].abs().max().item(), f"MHA vs absorbed logits differ by {err:.3g}"
