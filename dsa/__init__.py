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
    "absorb_kv_b": "dsa.absorb",
    "LightningIndexer": "dsa.indexer",
    "DSAAttention": "dsa.attention",
    "BatchPlan": "dsa.plan",
    "DSAModel": "dsa.model",
    "Engine": "dsa.engine",
    "SamplingParams": "dsa.sampling",
    "LLM": "dsa.llm",
    "Completion": "dsa.llm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsa' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
