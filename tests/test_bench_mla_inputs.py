"""``dsa bench mla``'s decode inputs: each row's slots distinct and its request's own, and next_n >= 2 rows
sharing a set share of row 0's slots, as real verify steps do (benchmarks/verify_overlap.py)."""
import pytest
import torch

from dsa.bench.mla import CTX, K, decode_slots


@pytest.mark.parametrize("b,n,ctx,overlap", [(1, 1, CTX, None), (3, 2, CTX, None), (2, 3, 4096, 0.59), (5, 2, CTX, 0.0),
                                             (2, 2, 2 * K, 1.0)], ids=lambda v: str(v))
def test_decode_slots_are_distinct_in_their_request_with_the_overlap_asked(b, n, ctx, overlap):
    slots = decode_slots(b, n, "cpu", ctx=ctx, overlap=overlap).long()
    assert slots.shape == (b * n, K) and slots.dtype == torch.int64
    req = torch.arange(b).repeat_interleave(n)[:, None]
    assert ((slots >= req * ctx) & (slots < (req + 1) * ctx)).all(), "a slot outside its request's rows"
    for r, row in enumerate(slots):
        assert len(set(row.tolist())) == K, f"row {r}: repeated slots"
    if overlap is None:
        return
    rows = slots.view(b, n, K)
    for i in range(b):
        first = set(rows[i, 0].tolist())
        for j in range(1, n):
            shared = len(first & set(rows[i, j].tolist()))
            assert shared == round(overlap * K), f"request {i} row {j}: {shared} of row 0's slots, not {overlap} x {K}"


def test_independent_rows_are_the_slots_of_before():
    g = torch.Generator().manual_seed(0)  # the committed rows' inputs: one draw of [B * N, CTX], top-K of each
    pick = torch.rand(4, CTX, generator=g).topk(K, dim=1).indices
    want = (torch.arange(2).repeat_interleave(2)[:, None] * CTX + pick).to(torch.int32)
    assert torch.equal(decode_slots(2, 2, "cpu"), want)
