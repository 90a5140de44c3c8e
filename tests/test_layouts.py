"""Byte layouts of the indexer key cache (planar) and the 656-byte FP8 latent cache, read raw."""
import pytest
import torch

from dsa.cache import IndexerKeyCache, LatentCache, write_indexer_keys, write_latent
from dsa.kernels import quant_ue8m0
from dsa.kernels.layouts import indexer_cache_views, latent_fp8_views

DI = 128


@pytest.mark.parametrize("block_size", [1, 16, 61, 64], ids=lambda p: f"P{p}")
def test_indexer_key_bytes_at_documented_offsets(block_size):
    g = torch.Generator().manual_seed(block_size)
    t = 37
    nb = -(-2 * t // block_size)
    cache = IndexerKeyCache(nb, block_size)
    k = (torch.randn(t, DI, generator=g) * torch.rand(t, 1, generator=g) * 10).to(torch.bfloat16)
    slots = torch.randperm(nb * block_size, generator=g)[:t]
    slots[3] = -1
    write_indexer_keys(cache, k, slots)
    k8, scale = quant_ue8m0(k)
    raw = cache.data  # [NB, P * 132] uint8, read with plain offsets
    written = torch.zeros(nb * block_size, dtype=torch.bool)
    for i in range(t):
        s = int(slots[i])
        if s < 0:
            continue
        written[s] = True
        b, off = divmod(s, block_size)
        assert torch.equal(raw[b, off * DI:(off + 1) * DI], k8[i].view(torch.uint8))
        sb = raw[b, block_size * DI + 4 * off: block_size * DI + 4 * off + 4]
        assert torch.equal(sb, scale[i].view(torch.uint8))
    # every other token record is untouched (the slot -1 row wrote nothing)
    for s in torch.nonzero(~written).flatten().tolist():
        b, off = divmod(s, block_size)
        assert not raw[b, off * DI:(off + 1) * DI].any()
        assert not raw[b, block_size * DI + 4 * off: block_size * DI + 4 * off + 4].any()


def test_row_view_is_not_a_token_record():
    p = 16
    cache = IndexerKeyCache(2, p)
    k = torch.randn(2 * p, DI).to(torch.bfloat16)
    write_indexer_keys(cache, k, torch.arange(2 * p))
    k8, scale = quant_ue8m0(k)
    wrong = cache.data.view(2, p, DI + 4)  # the tempting, wrong view
    assert not torch.equal(wrong[0, 1, :DI], k8[1].view(torch.uint8))
    assert not torch.equal(wrong[0, 1, DI:], scale[1].view(torch.uint8))
    k8_view, scale_view = indexer_cache_views(cache.data, p)
    assert torch.equal(k8_view[0, 1].view(torch.uint8), k8[1].view(torch.uint8))
    assert torch.equal(scale_view[0, 1], scale[1, 0])


def test_latent_fp8_656_bytes():
    g = torch.Generator().manual_seed(0)
    cache = LatentCache(3, 16, format="fp8")
    t = 7
    kv_c = (torch.randn(t, 512, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e-6]).repeat_interleave(128)).to(torch.bfloat16)
    k_pe = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    slots = torch.tensor([0, 5, 17, -1, 47, 20, 33])
    write_latent(cache, kv_c, k_pe, slots)
    raw = cache.data.view(-1, 656)
    for i in range(t):
        s = int(slots[i])
        if s < 0:
            continue
        row = raw[s]
        scales = row[512:528].view(torch.float32)
        for j in range(4):
            tile = kv_c[i, 128 * j:128 * (j + 1)].float()
            r = max(float(tile.abs().max()) / 448, 1e-4)
            want = 2.0 ** torch.tensor(r, dtype=torch.float64).log2().ceil().item()
            assert scales[j].item() == want, (i, j)
            q = (tile / want).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(row[128 * j:128 * (j + 1)], q.view(torch.uint8))
        assert torch.equal(row[528:656], k_pe[i].view(torch.uint8))
    untouched = torch.ones(raw.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not raw[untouched].any()
    kv8, scale, kpe = latent_fp8_views(cache.data)
    assert kv8.shape == (3, 16, 512) and scale.shape == (3, 16, 4) and kpe.shape == (3, 16, 64)


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_latent_plain_rows(fmt, dtype):
    cache = LatentCache(2, 16, format=fmt)
    kv_c, k_pe = torch.randn(3, 512, dtype=dtype), torch.randn(3, 64, dtype=dtype)
    write_latent(cache, kv_c, k_pe, torch.tensor([31, -1, 2], dtype=torch.int32))
    flat = cache.data.view(-1, 576)
    assert torch.equal(flat[31], torch.cat((kv_c[0], k_pe[0])))
    assert torch.equal(flat[2], torch.cat((kv_c[2], k_pe[2])))
    assert flat.count_nonzero(dim=1).gt(0).sum() == 2
