"""BatchPlan routing (which path serves which rows) and the dispatch thresholds."""
import json

import pytest
import torch

from dsa import BatchPlan, DSAConfig
from dsa.dispatch import Dispatch, load_dispatch


def _plan(query_lens, context_lens, k=16, dispatch=None, kv_bytes=0):
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(query_lens))]
    return BatchPlan.build(query_lens, context_lens, tables, 16, "cpu", index_topk=k, dispatch=dispatch,
                           mha_kv_bytes_per_token=kv_bytes)


def test_rows_split_by_valid_range():
    # decode with S=16 (fits), decode with S=17 (sparse), a prefill chunk straddling index_topk
    plan = _plan([1, 1, 10], [15, 16, 10])
    counts = plan.row_counts()
    assert counts["dense_decode"] == 1 and counts["sparse_decode"] == 1
    # chunk positions 10..19: 10..15 have ranges <= 16 (dense), 16..19 sparse
    assert counts["dense_prefill_absorbed"] == 6 and counts["sparse_prefill"] == 4
    assert plan.positions.tolist()[2:] == list(range(10, 20))
    assert plan.valid_lens.tolist()[:2] == [16, 17]
    assert plan.slot_mapping[0].item() == 0 * 16 + 15
    assert plan.seq_lens.tolist() == [16, 17, 20]
    assert plan.decode_reqs == [0, 1] and plan.prefill_reqs == [2]


def test_no_indexer_is_all_dense():
    counts = _plan([1, 40], [100, 0], k=None).row_counts()
    assert counts["sparse_decode"] == counts["sparse_prefill"] == 0
    assert counts["dense_decode"] == 1 and counts["dense_prefill_absorbed"] == 40


def test_analytic_rule_and_workspace():
    d = Dispatch(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert not d.prefill_uses_mha(100, 100_000, 0)  # Q < ~171: absorbed
    assert d.prefill_uses_mha(400, 100_000, 0)
    assert d.prefill_uses_mha(64, 64, 0)  # a cold prefill: S = Q
    assert not d.prefill_uses_mha(4096, 4096, 1 << 40)  # over the workspace: absorbed, same function
    counts = _plan([40], [0], k=None, dispatch=d, kv_bytes=1).row_counts()
    assert counts["dense_prefill_mha"] == 40


def test_thresholds_file_round_trip(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"gpu": "test", "decode_sparse_max_len": 64, "prefill_mha_min_query": 32}))
    cfg = DSAConfig.tiny(dispatch_thresholds=str(path))
    d = load_dispatch(cfg, torch.device("cpu"))
    assert d.source == "t.json" and d.decode_uses_sparse_kernel(64) and not d.decode_uses_sparse_kernel(65)
    assert d.prefill_uses_mha(32, 10_000, 0) and not d.prefill_uses_mha(31, 10, 0)
    plan = _plan([1, 1], [10, 63], k=16, dispatch=d)
    # the thresholds never move rows between dense and sparse: S=64 > index_topk stays sparse
    assert plan.row_counts()["sparse_decode"] == 1 and plan.row_counts()["dense_decode"] == 1
    assert plan.decode_sparse_kernel
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="dispatch_thresholds"):
        load_dispatch(DSAConfig.tiny(dispatch_thresholds=str(tmp_path / "bad.json")), torch.device("cpu"))


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="block_tables"):
        BatchPlan.build([5], [60], [[0, 1]], 16, "cpu")
    with pytest.raises(ValueError, match="query_lens"):
        BatchPlan.build([0], [0], [[0]], 16, "cpu")


def test_model_reads_the_thresholds_it_is_given(tmp_path):
    from dsa import DSAModel
    path = tmp_path / "dispatch_test.json"
    path.write_text(json.dumps({"decode_sparse_max_len": 32, "prefill_mha_min_query": 8}))
    model = DSAModel.random(DSAConfig.tiny(num_hidden_layers=1, dispatch_thresholds=str(path)), dtype=torch.float32,
                            device="cpu")
    assert model.dispatch.source == "dispatch_test.json" and model.dispatch.decode_sparse_max_len == 32
    assert DSAModel.random(DSAConfig.tiny(num_hidden_layers=1), dtype=torch.float32, device="cpu").dispatch.source \
        == "analytic"  # no file and no GPU: the seed's rule
