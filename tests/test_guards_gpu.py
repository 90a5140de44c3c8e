"""Ids outside their range never touch memory outside their tensor, on the GPU (marker ``gpu``).

Every op that takes ids runs on CUDA (its Triton kernel, and the torch reference) with each cache,
block table or length tensor allocated inside a larger buffer whose guard bytes hold a pattern:

- writes: the guards must stay intact;
- reads: the guards hold NaN (0xFF: NaN in e4m3, bf16 and fp32) for float data, 0x01 for int32
  data (a block id / length of 0x01010101 would show up as a real slot), so a read outside shows
  in the result.

The ids are both near (``NB``, ``NB * P``, ``-1``: the memory right beside the tensor, inside the
guards) and far (``2**31 - 1``, ``-2**31``, ``2**40``: an illegal address if anything reads them).
Each faulty call must give exactly the result of the same call with those ids replaced by -1.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.cache import IndexerKeyCache, gather_indexer_keys
from kernel_utils import Guarded

pytestmark = pytest.mark.gpu
P, NB = 64, 6
BACKENDS = ["triton", "torch"]
GUARD = 4 * P * 1152  # four blocks of the widest row on each side


def near_far(n):
    """Ids just outside ``[0, n)`` and far outside it (int32)."""
    return [n, n + 1, n + P - 1, -1, -2, -P - 1, 2 ** 31 - 1, -(2 ** 31), 2 ** 30]


def spoil(ids: torch.Tensor, n: int, gen, every: int = 3) -> torch.Tensor:
    """A copy of ``ids`` with every ``every``-th entry replaced by an id outside ``[0, n)``."""
    bad = torch.tensor(near_far(n), dtype=torch.int64)
    out = ids.clone().cpu().long().view(-1)
    pick = torch.arange(0, out.numel(), every)
    out[pick] = bad[torch.randint(0, len(bad), (len(pick),), generator=gen)]
    return out.view(ids.shape).to(ids.dtype).to(ids.device)


def minus_one(ids: torch.Tensor, n: int) -> torch.Tensor:
    return torch.where((ids >= 0) & (ids < n), ids, -1)


def latent(fmt, gen):
    width, dtype = (656, torch.uint8) if fmt == "fp8" else (576, torch.bfloat16)
    cache = Guarded((NB, P, width), dtype, "cuda", GUARD)  # NaN guards
    K.latent_write(cache.tensor, torch.randn(NB * P, 512, generator=gen).to(torch.bfloat16).cuda(),
                   torch.randn(NB * P, 64, generator=gen).to(torch.bfloat16).cuda(), torch.arange(NB * P, device="cuda"))
    return cache


def index_cache(gen):
    cache = Guarded((NB, P * 132), torch.uint8, "cuda", GUARD)
    K.indexer_key_write(cache.tensor, torch.randn(NB * P, 128, generator=gen).to(torch.bfloat16).cuda(),
                        torch.arange(NB * P, device="cuda"), P, True)
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_latent_write(backend, fmt, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    t = 300
    slots = spoil(torch.randperm(NB * P)[:t].to(slot_dtype), NB * P, gen).cuda()
    if slot_dtype == torch.int64:
        slots[5], slots[6] = 2 ** 40, -(2 ** 40)
    kv_c = torch.randn(t, 512, generator=gen).to(torch.bfloat16).cuda()
    k_pe = torch.randn(t, 64, generator=gen).to(torch.bfloat16).cuda()
    cache = latent(fmt, gen)
    expect = cache.tensor.clone()
    K.latent_write(cache.tensor, kv_c, k_pe, slots, backend=backend)
    K.latent_write(expect, kv_c, k_pe, minus_one(slots, NB * P), backend=backend)
    torch.cuda.synchronize()
    assert cache.intact(), "latent_write wrote outside the cache"
    assert torch.equal(cache.tensor.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_indexer_key_write(backend, slot_dtype):
    gen = torch.Generator().manual_seed(2)
    t = 300
    slots = spoil(torch.randperm(NB * P)[:t].to(slot_dtype), NB * P, gen).cuda()
    if slot_dtype == torch.int64:
        slots[5], slots[6] = 2 ** 40, -(2 ** 40)
    k = torch.randn(t, 128, generator=gen).to(torch.bfloat16).cuda()
    cache = index_cache(gen)
    expect = cache.tensor.clone()
    K.indexer_key_write(cache.tensor, k, slots, P, True, backend=backend)
    K.indexer_key_write(expect, k, minus_one(slots, NB * P), P, True, backend=backend)
    torch.cuda.synchronize()
    assert cache.intact(), "indexer_key_write wrote outside the cache"
    assert torch.equal(cache.tensor, expect)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t,h,k", [(3, 128, 256), (40, 16, 64)], ids=["T3-H128-K256", "T40-H16-K64"])
def test_sparse_mla(backend, fmt, t, h, k):
    gen = torch.Generator().manual_seed(3)
    cache = latent(fmt, gen)
    q = (torch.randn(t, h, 576, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    slots = spoil(torch.randint(0, NB * P, (t, k), generator=gen, dtype=torch.int32), NB * P, gen).cuda()
    slots[0] = torch.tensor(near_far(NB * P), dtype=torch.int32).repeat(k)[:k]  # no slot inside the cache
    out, lse = K.sparse_mla(q, cache.tensor, slots, 0.1, backend=backend)
    ref_out, ref_lse = K.sparse_mla(q, cache.tensor, minus_one(slots, NB * P), 0.1, backend=backend)
    torch.cuda.synchronize()
    assert cache.intact()
    assert torch.isfinite(out.float()).all(), "a guard (NaN) was read"
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not out[0].float().any() and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("n,h", [(1, 128), (2, 16)], ids=["N1-H128", "N2-H16"])
def test_dense_mla_decode(backend, fmt, n, h):
    gen = torch.Generator().manual_seed(4)
    b, mb = 5, NB
    cache = latent(fmt, gen)
    q = (torch.randn(b, n, h, 576, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    table = spoil(torch.stack([torch.randperm(NB) for _ in range(b)]).to(torch.int32), NB, gen, every=2).cuda()
    seq_lens = torch.tensor([NB * P, 1, 200, P, 333], dtype=torch.int32, device="cuda")
    out, lse = K.dense_mla_decode(q, cache.tensor, table, seq_lens, 0.1, backend=backend)
    ref_out, ref_lse = K.dense_mla_decode(q, cache.tensor, minus_one(table, NB), seq_lens, 0.1, backend=backend)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), "a guard (NaN) was read"
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,hi", [(1, 64), (2, 32)], ids=["N1-HI64", "N2-HI32"])
def test_indexer_logits_paged(backend, n, hi):
    gen = torch.Generator().manual_seed(5)
    b = 5
    cache = index_cache(gen)
    q8 = torch.randn(b, n, hi, 128, generator=gen).to(torch.float8_e4m3fn).cuda()
    w = torch.randn(b, n, hi, generator=gen).cuda()
    table = spoil(torch.stack([torch.randperm(NB) for _ in range(b)]).to(torch.int32), NB, gen, every=2).cuda()
    seq_lens = torch.tensor([NB * P, 1, 200, P, 333], dtype=torch.int32, device="cuda")
    out = K.indexer_logits_paged(q8, w, cache.tensor, table, seq_lens, P, NB * P, backend=backend)
    ref = K.indexer_logits_paged(q8, w, cache.tensor, minus_one(table, NB), seq_lens, P, NB * P, backend=backend)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "a guard (NaN) was read"
    assert torch.equal(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_slots_row_to_req(backend):
    """Rows whose request id is outside [0, B) read no block-table row and no length: all -1. The table
    and lengths sit inside guards of 0x01 bytes, which would read as block 0x01010101 / length 0x01010101."""
    gen = torch.Generator().manual_seed(6)
    r, width, k, b, mb = 9, 3000, 64, 3, 48
    logits = torch.randn(r, width, generator=gen).cuda()
    lengths = torch.full((r,), width, dtype=torch.int32, device="cuda")
    table = Guarded((b, mb), torch.int32, "cuda", 4096, byte=0x01)
    table.tensor.copy_(spoil(torch.randint(0, 100, (b, mb), generator=gen, dtype=torch.int32), 100, gen))
    seq_lens = Guarded((b,), torch.int32, "cuda", 4096, byte=0x01)
    seq_lens.tensor.copy_(torch.tensor([3000, 1000, 2999], dtype=torch.int32))
    row_to_req = torch.tensor([0, 1, 2, -1, 3, 4, 2 ** 31 - 1, -(2 ** 31), 1], dtype=torch.int32, device="cuda")
    out = K.topk_slots(logits, lengths, k, table.tensor, row_to_req, seq_lens.tensor, P, backend=backend)
    positions = K.topk_indices(logits, lengths, k, backend="torch")
    expect = K.positions_to_slots(positions, table.tensor, row_to_req, seq_lens.tensor, P)
    torch.cuda.synchronize()
    assert table.intact() and seq_lens.intact()
    assert bool((out[3:8] == -1).all())
    assert torch.equal(out.sort(dim=1).values, expect.sort(dim=1).values)


def test_gather_indexer_keys_blocks_outside_the_cache():
    gen = torch.Generator().manual_seed(7)
    guarded = index_cache(gen)
    cache = IndexerKeyCache(NB, P, device="cuda")
    cache.data = guarded.tensor
    table = spoil(torch.stack([torch.randperm(NB) for _ in range(3)]).to(torch.int32), NB, gen, every=2).cuda()
    seq_lens = torch.tensor([NB * P, 100, 65], dtype=torch.int32, device="cuda")
    k8, scale = gather_indexer_keys(cache, table, seq_lens)
    ref8, ref_scale = gather_indexer_keys(cache, minus_one(table, NB), seq_lens)
    torch.cuda.synchronize()
    assert not torch.isnan(scale).any(), "a guard (NaN) was read"
    assert torch.equal(k8.view(torch.uint8), ref8.view(torch.uint8)) and torch.equal(scale, ref_scale)
