"""The model: MLA + DSA attention (:mod:`.attention`), the decoder (:mod:`.model`), one step's plan
(:mod:`.plan`, its routing :mod:`.route`, :mod:`.dispatch`), checkpoint loading, tensor parallelism
and the presets.

Its public names are imported when first used, so that :mod:`dsa.model.preset_names` (what ``--help``
lists) comes without torch."""
import importlib

_EXPORTS = {"absorb_kv_b": "dsa.model.absorb", "DSAAttention": "dsa.model.attention", "DSAModel": "dsa.model.model",
            "StepContext": "dsa.model.model", "PATHS": "dsa.model.route", "BatchPlan": "dsa.model.plan",
            "HostPlan": "dsa.model.plan", "PlanOptions": "dsa.model.route"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsa.model' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
