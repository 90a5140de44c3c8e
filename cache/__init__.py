"""Paged storage objects (imports ``dsa.kernels``, never the model); blocks are handed out by the
engine's block manager (:mod:`dsa.engine.blocks`)."""
from .storage import IndexerKeyCache, LatentCache, gather_indexer_keys, write_indexer_keys, write_latent

__all__ = ["IndexerKeyCache", "LatentCache", "gather_indexer_keys", "write_indexer_keys", "write_latent"]
