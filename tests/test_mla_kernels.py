"""Triton sparse MLA, dense absorbed decode and latent write under the CPU interpreter, small odd shapes."""
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.common import TRITON_INTERPRET
from dsa.kernels.slots import positions_to_slots_reference
from dsa.testing import random_block_tables
from kernel_utils import owned_slots, poison_unowned_rows

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not TRITON_INTERPRET,
                                reason="interpreter tests run on CPU with TRITON_INTERPRET=1")
P = 16
SCALE = 0.1352


def make_cache(fmt, seq_lens, seed=0):
    """Paged cache with random rows for ``seq_lens``; every row no request owns is NaN."""
    g = torch.Generator().manual_seed(seed)
    table, nb = random_block_tables(seq_lens, P, extra_blocks=2, generator=g)
    shape = (nb, P, 656) if fmt == "fp8" else (nb, P, 576)
    cache = torch.zeros(shape, dtype=torch.uint8 if fmt == "fp8" else torch.bfloat16)
    owned = owned_slots(table, seq_lens, P)
    kv_c = (torch.randn(len(owned), 512, generator=g) * torch.rand(len(owned), 1, generator=g) * 4).to(torch.bfloat16)
    K.latent_write_reference(cache, kv_c, torch.randn(len(owned), 64, generator=g).to(torch.bfloat16), owned)
    poison_unowned_rows(cache, owned)
    return cache, table, owned


def check_attention(out, lse, ref_out, ref_lse):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all()
    ref = ref_out.float()
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max().clamp_min(1e-30)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.isneginf(lse[~fin]).all()
    assert not out[~fin].float().any()  # rows with no valid slot are exactly 0
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t,h,k", [(1, 4, 48), (5, 1, 16), (3, 16, 48), (2, 17, 32)],
                         ids=["T1-H4-K48", "T5-H1-K16", "T3-H16-K48", "T2-H17-K32"])
def test_sparse_mla_matches_reference(fmt, t, h, k):
    seq_lens = [70, 41]
    cache, table, owned = make_cache(fmt, seq_lens, seed=t * 100 + h)
    g = torch.Generator().manual_seed(k)
    q = (torch.randn(t, h, 576, generator=g) * 0.3).to(torch.bfloat16)
    slots = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):  # distinct random owned slots, a random number of them, -1 scattered in between
        n_valid = int(torch.randint(1, k + 1, (1,), generator=g))
        pick = owned[torch.randperm(len(owned), generator=g)[:n_valid]].to(torch.int32)
        slots[i, torch.randperm(k, generator=g)[:len(pick)]] = pick
    if t > 1:
        slots[1] = -1  # a row with nothing valid: out 0, lse -inf
    out, lse = K.sparse_mla(q, cache, slots, SCALE, backend="triton")
    ref_out, ref_lse = K.sparse_mla_reference(q.float(), cache, slots, SCALE)
    check_attention(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("n,h", [(1, 4), (2, 3)], ids=["N1-H4", "N2-H3"])
def test_dense_decode_matches_reference_and_sparse(fmt, n, h):
    seq_lens = [1, 16, 37, 70]  # request 0 has S < N when N = 2: its first query sees nothing
    cache, table, owned = make_cache(fmt, seq_lens, seed=n)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(len(seq_lens), n, h, 576, generator=g) * 0.3).to(torch.bfloat16)
    out, lse = K.dense_mla_decode(q, cache, table, lens, SCALE, backend="triton")
    ref_out, ref_lse = K.dense_mla_decode_reference(q.float(), cache, table, lens, SCALE)
    assert out.shape == (len(seq_lens), n, h, 512) and lse.shape == (len(seq_lens), n, h)
    check_attention(out, lse, ref_out, ref_lse)
    # the sparse kernel with every visible position selected computes the same function
    w = 80
    pos = torch.arange(w, dtype=torch.int32)
    last = (lens[:, None] - n + torch.arange(n)).reshape(-1)
    positions = torch.where(pos <= last[:, None], pos, -1).to(torch.int32)
    row_to_req = torch.arange(len(seq_lens), dtype=torch.int32).repeat_interleave(n)
    slots = positions_to_slots_reference(positions, table, row_to_req, lens, P)
    out_s, lse_s = K.sparse_mla(q.flatten(0, 1), cache, slots, SCALE, backend="triton")
    check_attention(out_s, lse_s, out.flatten(0, 1), lse.flatten(0, 1))


@pytest.mark.parametrize("k", [1, 24, 37], ids=lambda k: f"K{k}")
def test_sparse_any_k_is_padded_inside_the_op(k):
    """The op owns its tile constraint: K that is not a multiple of 16 is padded with skipped slots."""
    g = torch.Generator().manual_seed(k)
    q = (torch.randn(3, 4, 576, generator=g) * 0.3).to(torch.bfloat16)
    cache = (torch.randn(4, 16, 576, generator=g) * 0.5).to(torch.bfloat16)
    slots = torch.randint(-1, 64, (3, k), generator=g, dtype=torch.int32)
    out, lse = K.sparse_mla(q, cache, slots, SCALE, backend="triton")
    ref_out, ref_lse = K.sparse_mla_reference(q.float(), cache.float(), slots, SCALE)
    check_attention(out, lse, ref_out, ref_lse)


def latent_write_inputs(t, seed):
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(t, 512, generator=g) * torch.logspace(-6, 3, t)[:, None]
    kv_c[0] = 0  # amax 0: the 1e-4 floor
    kv_c[1, :128] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two: no rounding up
    kv_c[1, 128:256] = torch.linspace(-1, 1, 128) * 3.0  # ties for round-to-nearest-even once scaled
    kv_c[2, 256:384] = torch.finfo(torch.bfloat16).max / 4
    k_pe = torch.randn(t, 64, generator=g)
    return kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_latent_write_bytes_equal_reference(fmt, index_dtype):
    t, nb = 13, 3
    kv_c, k_pe = latent_write_inputs(t, seed=3)
    slots = torch.randperm(nb * P)[:t].to(index_dtype)
    slots[[4, 9]] = -1
    row_bytes = 656 if fmt == "fp8" else 576 * 2
    want = torch.full((nb, P, row_bytes), 0xAB, dtype=torch.uint8)  # rows not written keep these bytes
    want = want if fmt == "fp8" else want.view(torch.bfloat16)
    got = want.clone()
    K.latent_write_reference(want, kv_c, k_pe, slots)
    K.latent_write(got, kv_c, k_pe, slots, backend="triton")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
