"""The model: MLA + DSA attention (:mod:`.attention`), the decoder (:mod:`.model`), one step's plan
(:mod:`.plan`, :mod:`.dispatch`), checkpoint loading, tensor parallelism and the presets."""
from dsa.model.absorb import absorb_kv_b
from dsa.model.attention import DSAAttention
from dsa.model.model import DSAModel, StepContext
from dsa.model.plan import PATHS, BatchPlan, HostPlan

__all__ = ["BatchPlan", "DSAAttention", "DSAModel", "HostPlan", "PATHS", "StepContext", "absorb_kv_b"]
