"""The lightning indexer: scores cached positions per query token and selects the top-k as slots."""
from dsa.config import layer_runs_indexer

from .batch import DecodeRows, IndexerBatch, PrefillRows, Selection
from .lightning import LightningIndexer

__all__ = ["DecodeRows", "IndexerBatch", "LightningIndexer", "PrefillRows", "Selection", "layer_runs_indexer"]
