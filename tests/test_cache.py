"""The cache storage objects."""
import pytest
import torch

from dsa.cache import IndexerKeyCache, LatentCache, gather_indexer_keys, write_indexer_keys
from dsa.kernels import quant_ue8m0


def test_cache_shapes_and_bytes():
    assert IndexerKeyCache(3, 64).data.shape == (3, 64 * 132)
    assert IndexerKeyCache(3, 64).bytes_per_token == 132
    exact = IndexerKeyCache(3, 16, precision="exact", dtype=torch.float32)
    assert exact.data.shape == (3, 16, 128) and exact.data.dtype == torch.float32
    assert LatentCache(2, 16).data.shape == (2, 16, 576) and LatentCache(2, 16).bytes_per_token == 1152
    assert LatentCache(2, 16, format="fp8").data.shape == (2, 16, 656)
    assert LatentCache(2, 16, format="fp32").bytes_per_token == 2304
    with pytest.raises(ValueError, match="format"):
        LatentCache(2, 16, format="int8")
    with pytest.raises(ValueError, match="precision"):
        IndexerKeyCache(2, 16, precision="fp4")
    with pytest.raises(ValueError, match="block_size"):
        IndexerKeyCache(2, 0)


def test_gather_concatenates_requests_in_order():
    p = 16
    cache = IndexerKeyCache(6, p)
    table = torch.tensor([[4, 1, 0], [2, 5, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 17], dtype=torch.int32)
    keys = torch.randn(37, 128).to(torch.bfloat16)
    slots = torch.cat((torch.cat((4 * p + torch.arange(16), 1 * p + torch.arange(4))),
                       torch.cat((2 * p + torch.arange(16), 5 * p + torch.arange(1)))))
    write_indexer_keys(cache, keys, slots)
    k8, k_scale = gather_indexer_keys(cache, table, lens)
    want8, want_scale = quant_ue8m0(keys)
    assert torch.equal(k8.view(torch.uint8), want8.view(torch.uint8))
    assert torch.equal(k_scale, want_scale[:, 0])
    with pytest.raises(ValueError, match="block_table"):
        gather_indexer_keys(cache, table[:, :1], lens)


def test_exact_cache_refuses_hadamard():
    cache = IndexerKeyCache(1, 16, precision="exact")
    with pytest.raises(ValueError, match="hadamard"):
        write_indexer_keys(cache, torch.randn(2, 128), torch.arange(2), hadamard=True)
