"""Sparse MLA, dense absorbed decode and latent write on the GPU at production shapes.

The attention tests run both kernels: the portable Triton one (``backend="triton"``) and the Hopper
one (``backend="hopper"``, on sm_90 only; elsewhere those cases skip with the reason).
"""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels import sparse_mla_hopper as hopper
from dsa.kernels.slots import positions_to_slots_reference
from dsa.testing import random_block_tables
from kernel_utils import owned_slots, poison_unowned_rows

pytestmark = pytest.mark.gpu
P = 64
SCALE = 0.1352
DEV = "cuda"
HOPPER_REASON = hopper.unsupported_reason(torch.device(DEV), 64) if torch.cuda.is_available() else "no CUDA"


@pytest.fixture(params=["triton", "hopper"])
def backend(request):
    """The kernel under test; a Hopper case with H not a multiple of 64 checks the routing instead."""
    if request.param == "hopper" and HOPPER_REASON is not None:
        pytest.skip(f"Hopper kernel: {HOPPER_REASON}")
    return request.param


def run_sparse(backend, q, cache, slots):
    """``sparse_mla`` with ``backend``; for the Hopper kernel with H % 64 != 0: "auto" must route to the
    portable kernel (bitwise its result) and an explicit "hopper" must refuse."""
    if backend == "hopper" and q.shape[1] % 64 != 0:
        with pytest.raises(ValueError, match="^backend"):
            K.sparse_mla(q, cache, slots, SCALE, backend="hopper")
        got = K.sparse_mla(q, cache, slots, SCALE, backend="auto")
        want = K.sparse_mla(q, cache, slots, SCALE, backend="triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        return got
    return K.sparse_mla(q, cache, slots, SCALE, backend=backend)


def dirty_allocator():
    """Leave NaN in the memory the caching allocator hands out next, so unwritten outputs fail."""
    junk = torch.full((1 << 28,), float("nan"), device=DEV)  # 1 GiB
    del junk


def make_cache(fmt, seq_lens, seed=0):
    """Paged cache holding ``seq_lens`` requests in random blocks; every row no request owns is NaN."""
    g = torch.Generator().manual_seed(seed)
    table, nb = random_block_tables(seq_lens, P, extra_blocks=3, generator=g)
    table = table.to(DEV)
    shape = (nb, P, 656) if fmt == "fp8" else (nb, P, 576)
    cache = torch.zeros(shape, dtype=torch.uint8 if fmt == "fp8" else torch.bfloat16, device=DEV)
    owned = owned_slots(table, seq_lens, P)
    n = len(owned)
    kv_c = (torch.randn(n, 512, device=DEV) * torch.rand(n, 1, device=DEV) * 4).to(torch.bfloat16)
    K.latent_write(cache, kv_c, torch.randn(n, 64, device=DEV).to(torch.bfloat16), owned)
    poison_unowned_rows(cache, owned)
    return cache, table, owned


def random_slots(t, k, owned, seed):
    """Distinct owned slots per row, a random number of them, -1 elsewhere; row 1 all -1."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pick = torch.rand(t, len(owned), generator=g, device=DEV).topk(k, dim=1).indices  # distinct per row
    slots = owned[pick].to(torch.int32)
    n_valid = torch.randint(1, k + 1, (t, 1), generator=g, device=DEV)
    n_valid[0] = k
    keep = torch.rand(t, k, generator=g, device=DEV).argsort(dim=1) < n_valid  # -1 scattered in between
    slots = torch.where(keep, slots, -1)
    if t > 1:
        slots[1] = -1
    return slots


def check_attention(out, lse, ref_out, ref_lse):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    ref = ref_out.float()
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.isneginf(lse[~fin]).all()
    assert not out[~fin].float().any()
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t,h,k", [(1, 128, 2048), (37, 16, 2048), (64, 128, 2048), (4096, 64, 2048), (5, 64, 1040),
                                   (3, 192, 2064)], ids=lambda v: str(v))
def test_sparse_mla(fmt, t, h, k, backend):
    """Splits and merges (T=1, 5, 3), one program per head tile, K not a whole number of tile pairs."""
    cache, table, owned = make_cache(fmt, [3000, 5000], seed=t)
    q = (torch.randn(t, h, 576, device=DEV) * 0.3).to(torch.bfloat16)
    slots = random_slots(t, k, owned, seed=h)
    dirty_allocator()
    out, lse = run_sparse(backend, q, cache, slots)
    ref_out, ref_lse = K.sparse_mla_reference(q.float(), cache, slots, SCALE)
    check_attention(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sparse_mla_runs_of_invalid_slots(fmt, backend):
    """Whole tiles and tile pairs of -1, a row valid only in its last tile, slots outside [0, NB*P)
    and below -1: all read nothing (compared with the reference on the same slots set to -1)."""
    t, h, k = 6, 128, 2048
    cache, table, owned = make_cache(fmt, [3000, 5000], seed=3)
    q = (torch.randn(t, h, 576, device=DEV) * 0.3).to(torch.bfloat16)
    slots = random_slots(t, k, owned, seed=5)
    slots[0, :1024] = -1  # eight whole tile pairs
    slots[2, 64:128] = -1  # the second tile of the first pair
    slots[3, :-16] = -1  # only the last 16 slots
    outside = slots.clone()
    num_slots = cache.shape[0] * P
    outside[4, ::3] = num_slots + torch.arange(0, k, 3, device=DEV, dtype=torch.int32)[: outside[4, ::3].numel()]
    outside[5, 1::5] = -7
    outside[5, 2::5] = torch.iinfo(torch.int32).max
    clean = torch.where((outside >= 0) & (outside < num_slots), outside, -1)
    dirty_allocator()
    out, lse = K.sparse_mla(q, cache, outside, SCALE, backend=backend)
    ref_out, ref_lse = K.sparse_mla_reference(q.float(), cache, clean, SCALE)
    check_attention(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("n,h", [(1, 128), (2, 128), (4, 64)], ids=["N1-H128", "N2-H128", "N4-H64"])
def test_dense_decode_and_sparse_with_every_position(fmt, n, h, backend):
    seq_lens = [1, 2048, 777, 20000, 64]
    cache, table, owned = make_cache(fmt, seq_lens, seed=n)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = (torch.randn(len(seq_lens), n, h, 576, device=DEV) * 0.3).to(torch.bfloat16)
    dirty_allocator()
    out, lse = K.dense_mla_decode(q, cache, table, lens, SCALE, backend=backend)
    ref_out, ref_lse = K.dense_mla_decode_reference(q.float(), cache, table, lens, SCALE)
    check_attention(out, lse, ref_out, ref_lse)
    # requests with S <= 2048: the sparse kernel with every visible position is the same function
    short = [0, 1, 2, 4]
    pos = torch.arange(2048, dtype=torch.int32, device=DEV)
    last = (lens[short, None] - n + torch.arange(n, device=DEV)).reshape(-1)
    positions = torch.where(pos <= last[:, None], pos, -1).to(torch.int32)
    row_to_req = torch.tensor(short, dtype=torch.int32, device=DEV).repeat_interleave(n)
    slots = positions_to_slots_reference(positions, table, row_to_req, lens, P)
    out_s, lse_s = K.sparse_mla(q[short].flatten(0, 1), cache, slots, SCALE, backend=backend)
    check_attention(out_s, lse_s, out[short].flatten(0, 1), lse[short].flatten(0, 1))


def test_dense_decode_block_ids_outside_the_cache(backend):
    """Table entries outside [0, NB) past a request's owned blocks are never read; inside its length
    they read nothing (the same as -1 slots)."""
    seq_lens = [700, 1500]
    cache, table, owned = make_cache("bf16", seq_lens, seed=4)
    nb = cache.shape[0]
    wide = torch.cat([table, torch.full((2, 3), nb + 5, dtype=torch.int32, device=DEV)], dim=1)
    wide[1, 2] = -3  # positions 128..191 of request 1
    wide[1, 5] = nb  # positions 320..383
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = (torch.randn(2, 1, 128, 576, device=DEV) * 0.3).to(torch.bfloat16)
    out, lse = K.dense_mla_decode(q, cache, wide, lens, SCALE, backend=backend)
    pos = torch.arange(1500, dtype=torch.int32, device=DEV)
    positions = torch.where(pos[None, :] < lens[:, None], pos[None, :], -1).to(torch.int32)
    slots = positions_to_slots_reference(positions, table, torch.arange(2, dtype=torch.int32, device=DEV), lens, P)
    slots[1, 128:192] = -1
    slots[1, 320:384] = -1
    ref_out, ref_lse = K.sparse_mla_reference(q.flatten(0, 1).float(), cache, slots, SCALE)
    check_attention(out.flatten(0, 1), lse.flatten(0, 1), ref_out, ref_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_latent_write_bytes(fmt):
    t, nb = 4099, 100
    kv_c = torch.randn(t, 512, device=DEV) * torch.logspace(-7, 4, t, device=DEV)[:, None]
    kv_c[0] = 0
    kv_c[1, :128] = 448 * 2.0 ** -3
    kv_c = kv_c.to(torch.bfloat16)
    k_pe = torch.randn(t, 64, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(nb * P, device=DEV)[:t]
    slots[::7] = -1
    row_bytes = 656 if fmt == "fp8" else 1152
    want = torch.full((nb, P, row_bytes), 0xAB, dtype=torch.uint8, device=DEV)
    want = want if fmt == "fp8" else want.view(torch.bfloat16)
    got = want.clone()
    K.latent_write_reference(want, kv_c, k_pe, slots)
    K.latent_write(got, kv_c, k_pe, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        K.latent_write(got, kv_c, k_pe, slots)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_twenty_runs_bitwise_equal(fmt, backend):
    cache, table, owned = make_cache(fmt, [3000, 5000, 9000])
    lens = torch.tensor([3000, 5000, 9000], dtype=torch.int32, device=DEV)
    for t in (2, 64):  # split + merge, and one program per head tile
        q = (torch.randn(t, 128, 576, device=DEV) * 0.3).to(torch.bfloat16)
        slots = random_slots(t, 2048, owned, seed=t)
        first = K.sparse_mla(q, cache, slots, SCALE, backend=backend)
        for _ in range(19):
            again = K.sparse_mla(q, cache, slots, SCALE, backend=backend)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    qd = (torch.randn(3, 2, 128, 576, device=DEV) * 0.3).to(torch.bfloat16)
    first = K.dense_mla_decode(qd, cache, table, lens, SCALE, backend=backend)
    for _ in range(19):
        again = K.dense_mla_decode(qd, cache, table, lens, SCALE, backend=backend)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_cuda_graph_capture_and_replay(fmt, backend):
    cache, table, owned = make_cache(fmt, [3000, 5000])
    lens = torch.tensor([3000, 5000], dtype=torch.int32, device=DEV)
    q = (torch.randn(4, 128, 576, device=DEV) * 0.3).to(torch.bfloat16)
    qd = q[:2].view(2, 1, 128, 576).clone()
    slots = random_slots(4, 2048, owned, seed=1)
    K.sparse_mla(q, cache, slots, SCALE, backend=backend)
    K.dense_mla_decode(qd, cache, table, lens, SCALE, backend=backend)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = K.sparse_mla(q, cache, slots, SCALE, backend=backend)
        out_d, lse_d = K.dense_mla_decode(qd, cache, table, lens, SCALE, backend=backend)
    for seed in range(3):  # new inputs in place, replay, compare with eager calls
        g = torch.Generator(device=DEV).manual_seed(seed)
        q.copy_((torch.randn(q.shape, generator=g, device=DEV) * 0.3).to(torch.bfloat16))
        qd.copy_(q[:2].view(2, 1, 128, 576))
        slots.copy_(random_slots(4, 2048, owned, seed=seed + 10))
        graph.replay()
        want, want_lse = K.sparse_mla(q, cache, slots, SCALE, backend=backend)
        want_d, want_lse_d = K.dense_mla_decode(qd, cache, table, lens, SCALE, backend=backend)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert torch.equal(out_d, want_d) and torch.equal(lse_d, want_lse_d)
