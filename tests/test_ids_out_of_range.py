"""Ids outside their range read and write nothing, on both backends (Triton under the interpreter on CPU).

Every op that takes slots, block ids, request ids or positions is called with ids just outside the
cache (``NB * P``, block ``NB``, block ``-1``: the memory right beside it), and the cache lives inside
a buffer whose guard bytes are NaN: a write outside the cache breaks a guard, a read outside it
poisons the result. Far-out ids (``2**31 - 1``, ``2**40``), which could crash the interpreter if a
kernel regressed, run in ``test_fuzz.py``'s subprocess and in the GPU test ``test_guards_gpu.py``.
"""
import pytest
import torch

from dsa import kernels as K
from dsa.cache import IndexerKeyCache, gather_indexer_keys, write_indexer_keys
from kernel_utils import Guarded

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = dict(dtype=torch.int32, device=DEVICE)
P = 16
BACKENDS = ["torch", "triton"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- positions_to_slots / topk_slots: -1 for what cannot be mapped

def test_positions_to_slots_maps_what_it_cannot_to_minus_one():
    table = torch.tensor([[3, -1, 7], [2, 2 ** 31 - 1, 0]], **I32)  # block -1; a block whose slots pass int32
    seq_lens = torch.tensor([40, 50], **I32)
    positions = torch.tensor([[0, 17, 33, 40, -5],  # request 0: block 3, block -1, block 7, past S, negative
                              [1, 16, 48, 49, 60],  # request 1: block 2, int32 overflow, page past MB, ...
                              [0, 1, 2, 3, 4],  # row_to_req -1
                              [0, 1, 2, 3, 4],  # row_to_req B
                              [0, 1, 2, 3, 4]], **I32)  # row_to_req 2**31 - 1
    row_to_req = torch.tensor([0, 1, -1, 2, 2 ** 31 - 1], **I32)
    slots = K.positions_to_slots(positions, table, row_to_req, seq_lens, P)
    expect = torch.tensor([[3 * P, -1, 7 * P + 1, -1, -1],
                           [2 * P + 1, -1, -1, -1, -1]] + [[-1] * 5] * 3, **I32)
    assert torch.equal(slots, expect), slots


@pytest.mark.parametrize("shape", [(0, 4, 2, 3), (3, 0, 2, 3), (3, 4, 0, 3), (3, 4, 2, 0)],
                         ids=["R0", "k0", "B0", "MB0"])
def test_positions_to_slots_of_empty_inputs(shape):
    r, k, b, mb = shape
    slots = K.positions_to_slots(torch.zeros(r, k, **I32), torch.zeros(b, mb, **I32), torch.zeros(r, **I32),
                                 torch.full((b,), 5, **I32), P)
    assert slots.shape == (r, k) and slots.dtype == torch.int32 and bool((slots == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_slots_map_bad_ids_as_positions_to_slots(backend):
    g = _gen(1)
    r, width, k, b = 7, 90, 16, 3
    logits = torch.randn(r, width, generator=g).to(DEVICE)
    lengths = torch.tensor([90, 10, 70, 50, 33, 90, 64], **I32)
    table = torch.randint(0, 20, (b, 6), generator=g, dtype=torch.int32).to(DEVICE)
    table[0, 1], table[1, 0], table[2, 3] = -1, -(2 ** 31), 2 ** 31 - 1  # negative blocks, int32 overflow
    seq_lens = torch.tensor([90, 45, 80], **I32)
    row_to_req = torch.tensor([0, 1, -1, 2, 3, 4, 2], **I32)  # requests -1, B, B + 1 (far ones: test_fuzz.py)
    out = K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, P, backend=backend)
    positions = K.topk_indices_reference(logits, lengths, k)
    expect = K.positions_to_slots(positions, table, row_to_req, seq_lens, P)
    assert torch.equal(out.sort(dim=1).values, expect.sort(dim=1).values)
    assert bool((out[[2, 4, 5]] == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_negative_starts_count_from_zero(backend):
    g = _gen(2)
    logits = torch.randn(5, 120, generator=g).to(DEVICE)
    lengths = torch.tensor([100, 7, 50, 120, 0], **I32)
    starts = torch.tensor([-3, -1, -(2 ** 31), 0, -9], **I32)
    out = K.topk_indices(logits, lengths, 16, starts, backend=backend)
    expect = K.topk_indices_reference(logits, lengths, 16, starts.clamp_min(0))
    assert torch.equal(out.sort(dim=1).values, expect.sort(dim=1).values)


# ---- writes: a slot outside [0, NB * P) writes nothing

NEAR_SLOTS = ["NBP", "NBP+5", -1, -7]  # just past the cache, and negatives


def _bad_slots(n_good, nb, gen, dtype):
    good = torch.randperm(nb * P, generator=gen)[:n_good]
    bad = torch.tensor([nb * P + (5 if s == "NBP+5" else 0) if isinstance(s, str) else s for s in NEAR_SLOTS])
    slots = torch.cat((good, bad))[torch.randperm(n_good + len(bad), generator=gen)]
    return slots.to(dtype).to(DEVICE), torch.where((slots >= 0) & (slots < nb * P), slots, -1).to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_latent_write_skips_slots_outside_the_cache(backend, fmt, slot_dtype):
    g, nb = _gen(3), 3
    slots, clean = _bad_slots(9, nb, g, slot_dtype)
    t = len(slots)
    kv_c = torch.randn(t, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(t, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    shape, dtype = ((nb, P, 656), torch.uint8) if fmt == "fp8" else ((nb, P, 576), torch.bfloat16)
    cache = Guarded(shape, dtype, DEVICE, guard_bytes=2 * P * shape[-1] * dtype.itemsize)
    cache.tensor.zero_()
    expect = torch.zeros(shape, dtype=dtype, device=DEVICE)
    K.latent_write(cache.tensor, kv_c, k_pe, slots, backend=backend)
    K.latent_write(expect, kv_c, k_pe, clean, backend="torch")
    assert cache.intact(), "latent_write wrote outside the cache"
    assert torch.equal(cache.tensor.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_indexer_key_write_skips_slots_outside_the_cache(backend, slot_dtype):
    g, nb = _gen(4), 3
    slots, clean = _bad_slots(9, nb, g, slot_dtype)
    k = torch.randn(len(slots), 128, generator=g).to(torch.bfloat16).to(DEVICE)
    cache = Guarded((nb, P * 132), torch.uint8, DEVICE, guard_bytes=2 * P * 132)
    cache.tensor.zero_()
    expect = torch.zeros(nb, P * 132, dtype=torch.uint8, device=DEVICE)
    K.indexer_key_write(cache.tensor, k, slots, P, True, backend=backend)
    K.indexer_key_write(expect, k, clean, P, True, backend="torch")
    assert cache.intact(), "indexer_key_write wrote outside the cache"
    assert torch.equal(cache.tensor, expect)


def test_exact_indexer_cache_skips_slots_outside_it():
    cache = IndexerKeyCache(2, P, precision="exact", dtype=torch.float32, device=DEVICE)
    k = torch.randn(4, 128, device=DEVICE)
    write_indexer_keys(cache, k, torch.tensor([2 * P, 2 * P + 9, 5, -1], device=DEVICE))
    assert torch.equal(cache.data.view(-1, 128)[5], k[2]) and int((cache.data != 0).any(-1).sum()) == 1


# ---- reads: a slot or block id outside the cache is never read and contributes nothing

def _latent_cache(fmt, nb, gen):
    shape, dtype = ((nb, P, 656), torch.uint8) if fmt == "fp8" else ((nb, P, 576), torch.bfloat16)
    cache = Guarded(shape, dtype, DEVICE, guard_bytes=2 * P * shape[-1] * dtype.itemsize)  # NaN guards
    slots = torch.arange(nb * P, device=DEVICE)
    K.latent_write(cache.tensor, torch.randn(nb * P, 512, generator=gen).to(torch.bfloat16).to(DEVICE),
                   torch.randn(nb * P, 64, generator=gen).to(torch.bfloat16).to(DEVICE), slots, backend="torch")
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sparse_mla_skips_slots_outside_the_cache(backend, fmt):
    g, nb, t, h, k = _gen(5), 3, 4, 3, 32
    cache = _latent_cache(fmt, nb, g)
    q = (torch.randn(t, h, 576, generator=g) * 0.3).to(torch.bfloat16).to(DEVICE)
    slots = torch.randint(0, nb * P, (t, k), generator=g, dtype=torch.int32)
    slots[:, ::3] = torch.tensor([nb * P, nb * P + 3, -1, -5, nb * P + P - 1, -P], dtype=torch.int32).repeat(t, 2)[:, :11]
    slots[3] = nb * P  # a row with no slot inside the cache: out 0, lse -inf
    clean = torch.where((slots >= 0) & (slots < nb * P), slots, -1)
    out, lse = K.sparse_mla(q, cache.tensor, slots.to(DEVICE), 0.1, backend=backend)
    ref_out, ref_lse = K.sparse_mla(q, cache.tensor, clean.to(DEVICE), 0.1, backend=backend)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.isfinite(out.float()).all() and not out[3].float().any() and torch.isneginf(lse[3]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_mla_decode_skips_blocks_outside_the_cache(backend):
    g, nb, n, h = _gen(6), 4, 2, 3
    cache = _latent_cache("bf16", nb, g)
    seq_lens = torch.tensor([50, 40], **I32)
    table = torch.tensor([[0, nb, 2, -1], [-2, 3, nb + 1, 1]], **I32)  # ids NB, NB + 1, -1, -2: no block
    q = (torch.randn(2, n, h, 576, generator=g) * 0.3).to(torch.bfloat16).to(DEVICE)
    out, lse = K.dense_mla_decode(q, cache.tensor, table, seq_lens, 0.1, backend=backend)
    # the same function written out: query j of request b attends its positions <= S_b - N + j in valid blocks
    width = 64
    pos = torch.arange(width, device=DEVICE)
    block = table.long()[:, pos // P]  # [B, W]
    slot = torch.where((block >= 0) & (block < nb), block * P + pos % P, -1)
    last = seq_lens.long()[:, None] - n + torch.arange(n, device=DEVICE)  # [B, N]
    slots = torch.where(pos <= last[..., None], slot[:, None, :], -1).view(2 * n, width).to(torch.int32)
    ref_out, ref_lse = K.sparse_mla_reference(q.view(2 * n, h, 576).float(), cache.tensor, slots, 0.1)
    err = (out.float().view(2 * n, h, 512) - ref_out).abs().max() / ref_out.abs().max()
    assert torch.isfinite(out.float()).all() and err < 2e-2, err
    assert (lse.view(2 * n, h) - ref_lse).abs().max() < 1e-3


def test_gather_indexer_keys_reads_nothing_for_blocks_outside_the_cache():
    g = _gen(7)
    cache = IndexerKeyCache(3, P, device=DEVICE)
    keys = torch.randn(3 * P, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    write_indexer_keys(cache, keys, torch.arange(3 * P, device=DEVICE))
    table = torch.tensor([[2, 3, -1, 0]], **I32)  # blocks 3 (= NB) and -1 read nothing
    k8, k_scale = gather_indexer_keys(cache, table, torch.tensor([60], **I32))
    want8, want_scale = K.quant_ue8m0(keys.float())
    owned = torch.cat((torch.arange(2 * P, 3 * P), torch.arange(P, dtype=torch.long) * 0 - 1,
                       torch.arange(P, dtype=torch.long) * 0 - 1, torch.arange(12)))
    ok = owned >= 0
    assert torch.equal(k8.view(torch.uint8)[ok.to(DEVICE)], want8.view(torch.uint8)[owned[ok].to(DEVICE)])
    assert torch.equal(k_scale[ok.to(DEVICE)], want_scale[owned[ok].to(DEVICE), 0])
    assert not k8.view(torch.uint8)[~ok.to(DEVICE)].any() and not k_scale[~ok.to(DEVICE)].any()
    empty8, empty_scale = gather_indexer_keys(cache, torch.zeros(0, 4, **I32), torch.zeros(0, **I32))
    assert empty8.shape == (0, 128) and empty_scale.shape == (0,)


def test_apply_rope_leaves_positions_outside_the_table_unrotated():
    cos, sin = K.yarn_cos_sin(32, 64, 1e4, None)
    g = _gen(8)
    x = torch.randn(6, 3, 64, generator=g)
    positions = torch.tensor([5, -1, 32, 2 ** 40, -(2 ** 40), 31])
    out = K.apply_rope(x, positions, cos, sin, True)
    assert torch.equal(out[1:5], x[1:5])
    inside = K.apply_rope(x[[0, 5]], positions[[0, 5]], cos, sin, True)
    assert torch.equal(out[[0, 5]], inside) and not torch.equal(inside, x[[0, 5]])
