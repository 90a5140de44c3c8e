"""Paged storage objects and block allocation (imports ``dsa.kernels``, never the model)."""
from .allocator import BlockAllocator, CacheFullError
from .storage import IndexerKeyCache, LatentCache, gather_indexer_keys, write_indexer_keys, write_latent

__all__ = ["BlockAllocator", "CacheFullError", "IndexerKeyCache", "LatentCache", "gather_indexer_keys",
           "write_indexer_keys", "write_latent"]
