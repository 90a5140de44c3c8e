"""The engine: requests batched over one pool of paged caches. The :class:`.Scheduler` decides each
step's rows, the :class:`.BlockManager` owns the blocks and the prefix cache, the
:class:`.ModelRunner` plans and runs the step, the :class:`.Sampler` picks the tokens."""
from dsa.engine.engine import Engine, EngineStats
from dsa.engine.output import Delta
from dsa.engine.sampling import Logprob, SamplingParams

__all__ = ["Delta", "Engine", "EngineStats", "Logprob", "SamplingParams"]
