"""The lightning indexer (uses the skip policy of ``dsa.config``)."""
from dsa.config import layer_runs_indexer

__all__ = ["layer_runs_indexer"]
