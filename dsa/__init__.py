"""dsa: DeepSeek Sparse Attention for MLA models (FP8 lightning indexer, top-k, sparse absorbed MLA).

Public names are imported lazily so that ``import dsa.kernels`` stays light.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DSAConfig": "dsa.config",
    "layer_runs_indexer": "dsa.config",
    "bytes_per_token": "dsa.config",
    "softmax_scale": "dsa.config",
    "LightningIndexer": "dsa.indexer",
    "absorb_kv_b": "dsa.model",
    "DSAAttention": "dsa.model",
    "BatchPlan": "dsa.model",
    "DSAModel": "dsa.model",
    "Engine": "dsa.engine",
    "EngineStats": "dsa.engine",
    "SamplingParams": "dsa.engine",
    "Delta": "dsa.engine",
    "LLM": "dsa.serve",
    "Completion": "dsa.serve",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsa' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
