"""The lightning indexer (uses the skip policy of ``dsa.config``)."""
from dsa.config import layer_runs_indexer

from .lightning import LightningIndexer

__all__ = ["LightningIndexer", "layer_runs_indexer"]
