"""The torch references: absorption identity, sparse == dense, top-k and slot contracts, NaN isolation."""
import pytest
import torch

from dsa import absorb_kv_b
from dsa.cache import IndexerKeyCache, LatentCache, gather_indexer_keys, write_indexer_keys, write_latent
from dsa.kernels import (
    apply_rope,
    dense_mla_decode_reference,
    indexer_logits_paged_reference,
    indexer_logits_ragged_reference,
    indexer_query_prep_reference,
    positions_to_slots_reference,
    sparse_mla_reference,
    topk_indices_reference,
    topk_slots_reference,
    yarn_cos_sin,
)
from dsa.testing import calc_diff, random_block_tables
from kernel_utils import owned_slots, poison_unowned_indexer_rows, poison_unowned_rows


def test_absorption_identity_float64():
    """Absorbed attention over the latent == expanded per-head attention (192-wide K, 128-wide V)."""
    g = torch.Generator().manual_seed(0)
    h, d_nope, d_v, r, d_r, s, t = 3, 128, 128, 512, 64, 23, 4
    kv_b = torch.randn(h * (d_nope + d_v), r, dtype=torch.float64, generator=g) * r ** -0.5
    w_uk_t, w_uv = absorb_kv_b(kv_b, h, d_nope, d_v)
    c = torch.randn(s, r, generator=g).float()  # latent rows as the fp32 cache holds them
    k_pe = torch.randn(s, d_r, generator=g).float()
    q_nope = torch.randn(t, h, d_nope, dtype=torch.float64, generator=g)
    q_pe = torch.randn(t, h, d_r, dtype=torch.float64, generator=g)
    scale = (d_nope + d_r) ** -0.5
    # expanded, written out here: up-project the latent per head, share the RoPE slice
    per_head = kv_b.view(h, d_nope + d_v, r)
    k_nope = torch.einsum("hdr,sr->hsd", per_head[:, :d_nope], c.double())  # [H, S, 128]
    v = torch.einsum("hdr,sr->hsd", per_head[:, d_nope:], c.double())  # [H, S, 128]
    keys = torch.cat((k_nope, k_pe.double().expand(h, s, d_r)), dim=-1)  # [H, S, 192]
    queries = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, 192]
    probs = torch.softmax(torch.einsum("thd,hsd->ths", queries, keys) * scale, dim=-1)
    expected = torch.einsum("ths,hsd->thd", probs, v)
    # absorbed, through the library
    cache = LatentCache(2, 16, format="fp32")
    write_latent(cache, c, k_pe, torch.arange(s))
    q_abs = torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk_t), q_pe), dim=-1)  # [T, H, 576]
    slots = torch.arange(s, dtype=torch.int32).expand(t, s).contiguous()
    out, lse = sparse_mla_reference(q_abs, cache.data, slots, scale)
    got = torch.einsum("thr,hrd->thd", out, w_uv)
    assert out.dtype == torch.float64
    assert torch.allclose(got, expected, atol=1e-10, rtol=0)


def _latent_setup(fmt, seq_lens, block_size=16, h=4, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    table, nb = random_block_tables(seq_lens, block_size, extra_blocks=2, generator=g)
    cache = LatentCache(nb, block_size, format=fmt)
    owned = owned_slots(table, seq_lens, block_size)
    write_latent(cache, torch.randn(len(owned), 512, generator=g).to(torch.bfloat16),
                 torch.randn(len(owned), 64, generator=g).to(torch.bfloat16), owned)
    q = (torch.randn(len(seq_lens), n, h, 576, generator=g) * 0.05).to(torch.bfloat16)
    return cache, table, owned, q


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp32"])
def test_sparse_with_every_position_equals_dense(fmt):
    seq_lens = [1, 16, 37, 70]
    n = 2
    cache, table, owned, q = _latent_setup(fmt, seq_lens, n=n)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out_d, lse_d = dense_mla_decode_reference(q, cache.data, table, lens, 0.1)
    w = max(seq_lens)
    pos = torch.arange(w, dtype=torch.int32)
    last = (lens[:, None] - n + torch.arange(n)).reshape(-1)
    positions = torch.where(pos <= last[:, None], pos, -1).to(torch.int32)
    positions = positions[:, torch.randperm(w)].contiguous()  # order inside a row does not matter
    row_to_req = torch.arange(len(seq_lens), dtype=torch.int32).repeat_interleave(n)
    slots = positions_to_slots_reference(positions, table, row_to_req, lens, 16)
    out_s, lse_s = sparse_mla_reference(q.flatten(0, 1), cache.data, slots, 0.1)
    ref = out_d.flatten(0, 1).float()
    # request 0 has S=1 < N=2: its first query sees nothing
    assert torch.isneginf(lse_d[0, 0]).all() and not out_d[0, 0].float().any()
    assert (out_s.float() - ref).abs().max() / ref.abs().max() < 2e-2
    fin = torch.isfinite(lse_d.flatten(0, 1))
    assert torch.equal(fin, torch.isfinite(lse_s))
    assert (lse_s[fin] - lse_d.flatten(0, 1)[fin]).abs().max() < 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_nan_poisoned_rows_never_reach_the_output(fmt):
    seq_lens = [5, 33, 17]
    cache, table, owned, q = _latent_setup(fmt, seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    clean = dense_mla_decode_reference(q, cache.data, table, lens, 0.1)
    poison_unowned_rows(cache.data, owned)  # every row no request owns, tails of last blocks too
    assert torch.isnan(cache.data.float() if fmt == "bf16" else cache.data[..., :512].view(torch.float8_e4m3fn).float()).any()
    dirty = dense_mla_decode_reference(q, cache.data, table, lens, 0.1)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    slots = torch.full((3, 8), -1, dtype=torch.int32)
    slots[:, :3] = owned[:3].to(torch.int32)
    out, lse = sparse_mla_reference(q[:, 0], cache.data, slots, 0.1)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def test_all_minus_one_row():
    cache, table, owned, q = _latent_setup("bf16", [20])
    slots = torch.full((1, 32), -1, dtype=torch.int32)
    out, lse = sparse_mla_reference(q[:, 0], cache.data, slots, 0.1)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("length", [0, 1, 31, 32], ids=lambda n: f"len{n}")
def test_topk_short_rows_are_dense(length):
    logits = torch.randn(3, 50)
    starts = torch.tensor([0, 5, 18], dtype=torch.int32)
    idx = topk_indices_reference(logits, torch.full((3,), length, dtype=torch.int32), 32, starts)
    want = torch.cat((torch.arange(length), torch.full((32 - length,), -1))).to(torch.int32)
    assert torch.equal(idx, want.expand(3, 32))


def _assert_valid_topk(idx, logits, start, length, k):
    sel = idx[idx >= 0].long()
    assert len(sel) == min(k, length) and len(set(sel.tolist())) == len(sel)
    assert sel.min() >= 0 and sel.max() < length
    if length > k:
        assert torch.all(idx[len(sel):] == -1)
        vals = logits[start:start + length]
        chosen = torch.zeros(length, dtype=torch.bool)
        chosen[sel] = True
        if not torch.isnan(vals).any():
            assert vals[chosen].min() >= vals[~chosen].max()


@pytest.mark.parametrize("kind", ["random", "ties", "constant", "two_values", "nan_inside", "inf"])
def test_topk_contract(kind):
    g = torch.Generator().manual_seed(1)
    r, w, k = 4, 300, 32
    logits = {"random": torch.randn(r, w, generator=g),
              "ties": torch.randint(0, 5, (r, w), generator=g).float(),
              "constant": torch.full((r, w), 3.0),
              "two_values": torch.randint(0, 2, (r, w), generator=g).float(),
              "nan_inside": torch.where(torch.rand(r, w, generator=g) < 0.2, float("nan"), torch.randn(r, w, generator=g)),
              "inf": torch.where(torch.rand(r, w, generator=g) < 0.3, float("-inf"), torch.randn(r, w, generator=g))}[kind]
    starts = torch.tensor([0, 7, 100, 250], dtype=torch.int32)
    lengths = torch.tensor([300, 200, 33, 50], dtype=torch.int32)
    logits[1, 207:] = float("nan")  # garbage past the length
    idx = topk_indices_reference(logits, lengths, k, starts)
    for i in range(r):
        _assert_valid_topk(idx[i], logits[i], int(starts[i]), int(lengths[i]), k)


def test_positions_to_slots_edges():
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    pos = torch.tensor([[0, 17, 19, 20, -1, 40], [8, 9, 0, 3, 31, 32]], dtype=torch.int32)
    slots = positions_to_slots_reference(pos, table, torch.tensor([0, 1], dtype=torch.int32), lens, 16)
    assert slots.tolist() == [[48, 17, 19, -1, -1, -1], [8, -1, 0, 3, -1, -1]]
    logits = torch.randn(2, 40)
    both = topk_slots_reference(logits, torch.tensor([20, 9], dtype=torch.int32), 4, table,
                                torch.tensor([0, 1], dtype=torch.int32), lens, 16)
    want = positions_to_slots_reference(topk_indices_reference(logits, torch.tensor([20, 9], dtype=torch.int32), 4),
                                        table, torch.tensor([0, 1], dtype=torch.int32), lens, 16)
    assert torch.equal(both, want)


def _indexer_setup(seq_lens, n, hi=4, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    table, nb = random_block_tables(seq_lens, block_size, extra_blocks=1, generator=g)
    cache = IndexerKeyCache(nb, block_size)
    owned = owned_slots(table, seq_lens, block_size)
    write_indexer_keys(cache, torch.randn(len(owned), 128, generator=g).to(torch.bfloat16), owned, hadamard=True)
    q = torch.randn(len(seq_lens) * n, hi, 128, generator=g).to(torch.bfloat16)
    q8, weights = indexer_query_prep_reference(q, torch.randn(len(seq_lens) * n, hi, generator=g), True)
    return cache, table, owned, q8.view(len(seq_lens), n, hi, 128), weights.view(len(seq_lens), n, hi)


def test_paged_logits_match_ragged_and_mask():
    seq_lens, n = [3, 40, 17], 2
    cache, table, owned, q8, w = _indexer_setup(seq_lens, n)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    paged = indexer_logits_paged_reference(q8, w, cache.data, table, lens, 16)
    assert paged.shape == (6, 40)
    k8, k_scale = gather_indexer_keys(cache, table, lens)
    offsets = torch.tensor([0, 3, 43])
    starts = offsets.repeat_interleave(n).to(torch.int32)
    ends = (starts + (lens - n).repeat_interleave(n) + torch.arange(n).repeat(3) + 1).to(torch.int32)
    ragged = indexer_logits_ragged_reference(q8.flatten(0, 1), w.flatten(0, 1), k8, k_scale, starts, ends)
    for row in range(6):
        b = row // n
        mine = paged[row, :seq_lens[b]]
        theirs = ragged[row, offsets[b]:offsets[b] + seq_lens[b]]
        assert torch.equal(torch.isneginf(mine), torch.isneginf(theirs))
        fin = torch.isfinite(mine)
        assert calc_diff(mine[fin], theirs[fin]) < 1e-6
        assert torch.isneginf(paged[row, seq_lens[b] - n + row % n + 1:]).all()
    # fixed width for CUDA graphs
    wide = indexer_logits_paged_reference(q8, w, cache.data, table, lens, 16, max_seq_len=64)
    assert wide.shape == (6, 64) and torch.equal(wide[:, :40], paged) and torch.isneginf(wide[:, 40:]).all()


def test_paged_logits_ignore_poisoned_keys():
    seq_lens, n = [30, 9], 1
    cache, table, owned, q8, w = _indexer_setup(seq_lens, n)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    clean = indexer_logits_paged_reference(q8, w, cache.data, table, lens, 16)
    poison_unowned_indexer_rows(cache.data, owned, 16)
    assert torch.equal(indexer_logits_paged_reference(q8, w, cache.data, table, lens, 16), clean)


def test_exact_indexer_cache_scores_unquantized():
    g = torch.Generator().manual_seed(0)
    cache = IndexerKeyCache(2, 16, precision="exact", dtype=torch.float32)
    k = torch.randn(20, 128, generator=g)
    write_indexer_keys(cache, k, torch.arange(20))
    q = torch.randn(1, 1, 4, 128, generator=g)
    w = torch.randn(1, 1, 4, generator=g)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    got = indexer_logits_paged_reference(q, w, cache.data, table, torch.tensor([20], dtype=torch.int32), 16)
    want = (torch.relu(q[0, 0] @ k.T) * w[0, 0, :, None]).sum(0)
    assert torch.allclose(got[0], want, atol=1e-5)
    keys, scale = gather_indexer_keys(cache, table, torch.tensor([20], dtype=torch.int32))
    assert scale is None and torch.equal(keys, k)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rope_rotates_pairs(interleaved):
    cos, sin = yarn_cos_sin(32, 8, 10000.0, None)
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 31, 2])
    y = apply_rope(x, pos, cos, sin, interleaved)
    assert torch.allclose(y[0], x[0])  # position 0 is the identity
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep the norm
    pair = (0, 1) if interleaved else (0, 4)
    ang = torch.atan2(sin[7, 0], cos[7, 0]).double()
    a, b = x[2, :, pair[0]], x[2, :, pair[1]]
    assert torch.allclose(y[2, :, pair[0]], a * ang.cos() - b * ang.sin(), atol=1e-6)


def test_yarn_tables():
    scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cos, sin = yarn_cos_sin(4096, 64, 10000.0, scaling)
    plain_cos, plain_sin = yarn_cos_sin(4096, 64, 10000.0, None)
    assert cos.shape == (4096, 32)
    assert torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos), atol=1e-6)  # mscale ratio is 1 for V3.2
    assert torch.allclose(cos[:, 0], plain_cos[:, 0])  # high frequencies keep their value
    # the lowest frequency is divided by the factor: angle(p) = angle_plain(p) / 40
    angle, plain = torch.atan2(sin[1, -1], cos[1, -1]), torch.atan2(plain_sin[1, -1], plain_cos[1, -1])
    assert angle.item() == pytest.approx(plain.item() / 40, rel=1e-4)
