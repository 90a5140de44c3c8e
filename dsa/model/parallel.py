"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPU), as vLLM and SGLang split MLA.

Layout, per rank of ``tp`` ranks:

- MLA head-parallel: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` keep the rank's ``H / tp`` heads
  (rows), so the absorbed ``W_UK_T`` / ``W_UV`` are the rank's heads too; ``o_proj`` keeps the
  matching columns and its partial outputs are summed by one all-reduce. ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and the norms are replicated: the latent cache holds the whole 576-wide
  row on every rank (MLA has one shared KV head).
- The lightning indexer (weights and key cache) is replicated: every rank scores and selects the
  same positions from the same inputs with the same kernels (the tie rule makes ties agree too).
  Splitting it would need an all-reduce of a ``B x S`` logits tensor per layer.
- Dense MLP and shared experts: ``gate_proj`` / ``up_proj`` split by rows, ``down_proj`` by columns,
  one all-reduce. Routed experts are split by expert (rank ``r`` holds experts ``e % tp == r``), the
  router replicated; their sum joins the same all-reduce.
- Embeddings, final norm and ``lm_head`` are replicated, so every rank holds the same logits.

Every rank runs the same deterministic scheduler on the same requests (SPMD): steps, plans and
sampled tokens are identical on all ranks, no broadcast is needed (a server's requests reach the
other ranks from rank 0: :mod:`dsa.serve.tp_commands`). ``check_selection=True`` (off by
default) all-gathers a hash of every layer's slots per step and raises if the ranks disagree.

The all-reduce itself is :class:`dsa.model.allreduce.AllReduce` (symmetric memory for small
messages where it initializes, NCCL otherwise; ``tp.reducer.path`` says which).
:func:`without_all_reduce` turns every rank's all-reduce into a no-op, for ``dsa bench engine
--tp``'s measurement of the communication share only: the outputs are then partial sums, wrong.
"""
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .allreduce import AllReduce, disable_multicast

# parameter name suffix -> the dim split across ranks (0: rows, output features; 1: columns, inputs)
SPLIT_DIMS = {
    "self_attn.q_b_proj.weight": 0, "self_attn.q_proj.weight": 0, "self_attn.kv_b_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
    "shared_experts.gate_proj.weight": 0, "shared_experts.up_proj.weight": 0, "shared_experts.down_proj.weight": 1,
}


EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")

_skip_all_reduce = False  # set by without_all_reduce()


@contextmanager
def without_all_reduce():
    """Within: ``TensorParallel.all_reduce`` returns its input unreduced (each rank keeps its partial
    sum, so logits and tokens are wrong). For timing a step without its communication (``dsa bench
    engine --tp``, whose rows say so); a CUDA graph captured within replays without it too."""
    global _skip_all_reduce
    before, _skip_all_reduce = _skip_all_reduce, True
    try:
        yield
    finally:
        _skip_all_reduce = before


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (``size`` 1: no parallelism)."""
    size: int = 1
    rank: int = 0
    group: object = None
    check_selection: bool = False
    reducer: AllReduce | None = None  # None: the process group's all_reduce

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (a no-op for one rank, and within :func:`without_all_reduce`)."""
        if self.size == 1 or _skip_all_reduce:
            return x
        if self.reducer is not None:
            return self.reducer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def split(self, n: int, what: str) -> slice:
        """This rank's contiguous share of ``n`` (``n`` must divide evenly)."""
        if n % self.size:
            raise ValueError(f"{what}: {n} does not split over tp_size {self.size}")
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def owns_expert(self, e: int) -> bool:
        return e % self.size == self.rank

    def holds(self, name: str) -> bool:
        """Whether this rank holds (part of) the tensor ``name``: all but other ranks' experts."""
        m = EXPERT_RE.search(name)
        return m is None or self.owns_expert(int(m.group(1)))

    def shard(self, name: str, full_shape: tuple, config) -> tuple | None:
        """The slices of checkpoint tensor ``name`` (of ``full_shape``) this rank holds, or None when
        it holds all of it."""
        if self.size == 1:
            return None
        for suffix, dim in SPLIT_DIMS.items():
            if name.endswith(suffix):
                unit = _unit(suffix, config)  # rows or columns per head (MLA) or 1 (MLPs)
                n = full_shape[dim] // unit
                s = self.split(n, name)
                index = [slice(None)] * len(full_shape)
                index[dim] = slice(s.start * unit, s.stop * unit)
                return tuple(index)
        return None

    def check_same(self, what: str, t: torch.Tensor) -> None:
        """Raise unless ``t`` (an int tensor) has the same checksum on every rank (the debug check of
        the selection: one all-gather and a host read per call)."""
        if self.size == 1 or not self.check_selection:
            return
        flat = t.reshape(-1).long()
        mix = torch.arange(1, flat.numel() + 1, device=t.device, dtype=torch.int64) * 2654435761 % 4294967291
        h = (flat * mix).sum().reshape(1)  # wraps modulo 2**64: any bit that differs shows
        out = [torch.zeros_like(h) for _ in range(self.size)]
        dist.all_gather(out, h, group=self.group)
        if len({int(x) for x in out}) != 1:
            raise RuntimeError(f"{what}: the ranks selected different slots (checksums {[int(x) for x in out]})")


def _unit(suffix: str, config) -> int:
    if suffix.startswith("self_attn.q"):
        return config.qk_nope_head_dim + config.qk_rope_head_dim
    if suffix.startswith("self_attn.kv_b"):
        return config.qk_nope_head_dim + config.v_head_dim
    if suffix.startswith("self_attn.o_proj"):
        return config.v_head_dim
    return 1


def start_process_group(tp_size: int, *, backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the default process group of ``tp_size`` processes started by ``torchrun`` (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), unless one is already initialized: NCCL
    on CUDA (each rank on GPU ``LOCAL_RANK``), else gloo. ``timeout_s``: how long a collective
    waits for the other ranks before it fails (None: torch's default). NVLink multicast is turned
    off first (:func:`dsa.model.allreduce.disable_multicast`)."""
    disable_multicast()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError(f"tp_size {tp_size}: start one process per rank with torchrun "
                           f"(e.g. `torchrun --nproc-per-node {tp_size} -m dsa demo --tp {tp_size}`)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))


def init_tensor_parallel(tp_size: int, *, backend: str | None = None, check_selection: bool = False) -> TensorParallel:
    """Join (or start, :func:`start_process_group`) the default process group of ``tp_size``
    processes started by ``torchrun`` and return this rank's place. The all-reduce path is chosen
    here (collective)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
    if tp_size == 1:
        return TensorParallel()
    start_process_group(tp_size, backend=backend)
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tp_size: expected the world size {dist.get_world_size()}, got {tp_size}")
    return TensorParallel(tp_size, dist.get_rank(), None, check_selection, AllReduce())
