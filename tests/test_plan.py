"""BatchPlan: routing (which path serves which rows), the facts every layer reads, padding to a
graph bucket, and the dispatch thresholds."""
import json

import pytest
import torch

from dsa import BatchPlan, DSAConfig
from dsa.kernels import positions_to_slots
from dsa.model.dispatch import Dispatch, load_dispatch
from dsa.model.plan import HostPlan

P = 16


def _tables(n, per=8):
    return [list(range(i * per + 3, i * per + 3 + per))[::-1] for i in range(n)]  # non-contiguous blocks


def _plan(query_lens, context_lens, k=16, dispatch=None, kv_bytes=0, **kw):
    return BatchPlan.build(query_lens, context_lens, _tables(len(query_lens)), P, "cpu", index_topk=k,
                           dispatch=dispatch, mha_kv_bytes_per_token=kv_bytes, **kw)


def test_rows_split_by_valid_range():
    # decode with S=16 (fits: its top-k is every position), with S=17, a prefill chunk straddling index_topk
    plan = _plan([1, 1, 10], [15, 16, 10])
    assert plan.rows["sparse_decode"] == 2 and plan.rows["dense_decode"] == 0  # both run top-k + sparse
    # chunk positions 10..19: 10..15 have ranges <= 16 (dense), 16..19 sparse
    assert plan.rows["dense_prefill_absorbed"] == 6 and plan.rows["sparse_prefill"] == 4
    assert plan.positions.tolist() == [15, 16] + list(range(10, 20))
    assert plan.seq_lens.tolist() == [16, 17, 20] and plan.max_seq_len == 20
    assert plan.logits_rows.tolist() == [0, 1, 11]
    assert plan.decode.rows == slice(0, 2) and plan.decode.max_seq_len == 20 and plan.decode.every_position is None
    assert not plan.decode_only
    seg, = plan.absorbed
    assert (seg.req, seg.row0, seg.row1, seg.pos0, seg.num_keys) == (2, 2, 8, 10, 16)
    assert seg.seq_len.tolist() == [16]  # the segment's own context, not the request's
    pre, = plan.indexer.prefill
    assert pre.rows == slice(8, 12) and pre.valid_lens.tolist() == [17, 18, 19, 20] and pre.seq_len.tolist() == [20]
    assert (pre.pos0, pre.num_keys) == (16, 20)  # host sizes: the indexer gathers 20 keys without a sync
    assert plan.sparse_prefill_rows.tolist() == [8, 9, 10, 11]


def test_slots_come_from_positions_to_slots():
    plan = _plan([1, 3, 1], [20, 5, 40])
    tables = torch.tensor(_tables(3), dtype=torch.int32)
    want = positions_to_slots(plan.positions[:, None], tables, plan.row_to_req, plan.seq_lens, P)[:, 0]
    assert torch.equal(plan.slot_mapping, want)
    assert plan.slot_mapping.tolist()[0] == tables[0, 20 // P] * P + 20 % P
    # decode rows 0 and 4 are not contiguous: gathered per row, each row reads its own request's table
    assert plan.decode.rows.tolist() == [0, 4] and torch.equal(plan.decode.block_table, tables[[0, 2]])
    assert plan.decode.seq_lens.tolist() == [21, 41] and plan.decode.row_ids.tolist() == [0, 1]


def test_short_decode_steps_hand_every_position():
    """A decode-only step whose contexts all fit in index_topk: every position's slot, -1 after S
    (what top-k returns for such rows), so no indexer scoring is needed."""
    plan = _plan([1, 1], [4, 9], k=16)
    every = plan.decode.every_position
    assert plan.decode_only and every.shape == (2, 16)
    tables = torch.tensor(_tables(2), dtype=torch.int32)
    for r, s in enumerate([5, 10]):
        assert every[r, :s].tolist() == (tables[r, 0] * P + torch.arange(s)).tolist()
        assert (every[r, s:] == -1).all()


def test_no_indexer_is_all_dense():
    plan = _plan([1, 40], [100, 0], k=None)
    assert plan.rows["sparse_decode"] == plan.rows["sparse_prefill"] == 0
    assert plan.rows["dense_decode"] == 1 and plan.rows["dense_prefill_absorbed"] == 40
    assert plan.decode.every_position is None and plan.indexer.prefill == ()


def test_padding_to_a_graph_bucket():
    host = HostPlan.pack([1, 1, 1], [30, 7, 70], _tables(3), P, "cpu", index_topk=16, input_ids=[5, 6, 7],
                         num_rows=8, max_seq_len=256, num_block_columns=16)
    plan = host.derive(host.upload())
    assert plan.num_tokens == 8 and plan.decode_only and plan.max_seq_len == 256
    assert plan.block_table.shape == (8, 16) and plan.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert plan.seq_lens.tolist() == [31, 8, 71, 0, 0, 0, 0, 0]  # padding rows see nothing
    assert (plan.slot_mapping[3:] == -1).all() and (plan.slot_mapping[:3] >= 0).all()  # ... and write nowhere
    assert plan.rows["sparse_decode"] == 3 and plan.rows["dense_decode"] == 0  # real rows only
    again = HostPlan.pack([1], [3], _tables(1), P, "cpu", index_topk=16, input_ids=[1], num_rows=8,
                          max_seq_len=256, num_block_columns=16)
    assert again.spec == host.spec  # one bucket, one layout: a captured graph's buffer is refilled in place
    buf = torch.zeros(host.packer.size, dtype=torch.int32)
    assert again.derive(again.upload(buf)).input_ids.data_ptr() == buf.data_ptr() + again.spec["ids"][0] * 4
    with pytest.raises(ValueError, match="num_rows"):
        HostPlan.pack([2], [3], _tables(1), P, "cpu", num_rows=4)


def test_mha_segments_and_workspace():
    d = Dispatch(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert not d.prefill_uses_mha(100, 100_000, 0)  # Q < ~171: absorbed
    assert d.prefill_uses_mha(400, 100_000, 0)
    assert d.prefill_uses_mha(64, 64, 0)  # a cold prefill: S = Q
    assert not d.prefill_uses_mha(4096, 4096, 1 << 40)  # over the workspace: absorbed, same function
    plan = _plan([40], [0], k=None, dispatch=d, kv_bytes=3)
    seg, = plan.mha
    assert plan.rows["dense_prefill_mha"] == 40 and plan.workspace_bytes == 40 * 3
    assert seg.slots.tolist() == [plan.block_table[0, p // P].item() * P + p % P for p in range(40)]


def test_thresholds_file_round_trip(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"gpu": "test", "prefill_mha_min_query": 32}))
    d = load_dispatch(DSAConfig.tiny(dispatch_thresholds=str(path)), torch.device("cpu"))
    assert d.source == "t.json" and d.prefill_uses_mha(32, 10_000, 0) and not d.prefill_uses_mha(31, 10, 0)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="dispatch_thresholds"):
        load_dispatch(DSAConfig.tiny(dispatch_thresholds=str(tmp_path / "bad.json")), torch.device("cpu"))


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="block_tables"):
        BatchPlan.build([5], [60], [[0, 1]], 16, "cpu")
    with pytest.raises(ValueError, match="query_lens"):
        BatchPlan.build([0], [0], [[0]], 16, "cpu")
    with pytest.raises(ValueError, match="input_ids"):
        BatchPlan.build([3], [0], [[0]], 16, "cpu", input_ids=[1, 2])
    with pytest.raises(ValueError, match="max_seq_len"):
        BatchPlan.build([3], [20], [[0, 1]], 16, "cpu", max_seq_len=22)


def test_model_reads_the_thresholds_it_is_given(tmp_path):
    from dsa import DSAModel
    path = tmp_path / "dispatch_test.json"
    path.write_text(json.dumps({"prefill_mha_min_query": 8}))
    model = DSAModel.random(DSAConfig.tiny(num_hidden_layers=1, dispatch_thresholds=str(path)), dtype=torch.float32,
                            device="cpu")
    assert model.dispatch.source == "dispatch_test.json" and model.dispatch.prefill_mha_min_query == 8
    assert DSAModel.random(DSAConfig.tiny(num_hidden_layers=1), dtype=torch.float32, device="cpu").dispatch.source \
        == "analytic"  # no file and no GPU: the analytic rule
