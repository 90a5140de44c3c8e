"""The all-reduce of tensor parallelism: PyTorch's symmetric-memory kernels for small messages, the
process group's own all-reduce (NCCL, gloo) for everything else.

A decode step all-reduces ``B x hidden`` bf16 rows twice per layer (``o_proj`` and the MLP): 14 KiB
per row at hidden 7168, 0.9 MiB at B = 64. At those sizes NCCL's launch and protocol latency
dominates; the symmetric-memory kernels (``torch.ops.symm_mem``) read the peers' buffers directly
over NVLink instead.

The path is chosen once, when :class:`AllReduce` is built (every rank builds it at the same point:
it is collective), and kept in ``path`` with the ``reason``:

- ``"symm_mem"``: the group runs NCCL on CUDA, all its ranks are on one host, this torch has
  ``one_shot_all_reduce_out`` and ``two_shot_all_reduce_``, and a persistent symmetric buffer of
  ``max_bytes`` (1 MiB) was allocated and rendezvoused on every rank. A contiguous, 16-byte aligned
  bf16 or fp32 tensor of at most ``max_bytes`` (a multiple of 4 bytes) is copied into the buffer, summed there
  (one-shot up to ``one_shot_max_bytes``: every rank reads every peer's buffer and adds them in rank
  order; two-shot above: each rank sums a slice and writes it to every peer) and copied back; any
  other tensor goes through NCCL. Nothing is allocated per call, so a call can be captured in a
  CUDA graph (the buffer must exist before the capture: it is made here).
- otherwise the process group's ``all_reduce`` (``"nccl"`` or ``"gloo"``).

Numerics: every rank ends with the same bits on every path (one-shot adds the ranks in rank order on
every rank; two-shot and NCCL sum each element once and copy it). For two ranks the sum is ``a + b``
rounded once on both paths; for more ranks the order of the bf16 additions can differ from NCCL's,
so switching paths can move the last bit.

NVLink multicast (NVLS) stays off: this module never calls the ``multimem_*`` ops, and
:func:`disable_multicast` sets ``NCCL_NVLS_ENABLE=0`` (read by NCCL when a communicator is created),
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (read by torch's CUDA symmetric memory when it allocates and
rendezvouses) and ``NVSHMEM_DISABLE_NVLS=1`` (read by NVSHMEM at its init, only used with
``TORCH_SYMMMEM=NVSHMEM``), each unless already set. :func:`dsa.model.parallel.init_tensor_parallel`
calls it before ``init_process_group``, so all three are in place before anything reads them.
"""
import logging
import os
import socket

import torch
import torch.distributed as dist

log = logging.getLogger("dsa")

MAX_BYTES = 1 << 20  # messages up to this size take the symmetric-memory path
ONE_SHOT_MAX_BYTES = 256 << 10  # one-shot up to this size, two-shot above
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SYMM_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes the symm_mem kernels add


def disable_multicast() -> None:
    """Set the three variables that keep NCCL, torch symmetric memory and NVSHMEM off NVLink
    multicast, unless the environment already sets them."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


def symm_mem_ops() -> bool:
    """Whether this torch registers the two symmetric-memory all-reduce ops used here."""
    ops = getattr(torch.ops, "symm_mem", None)
    return ops is not None and all(hasattr(ops, n) for n in ("one_shot_all_reduce_out", "two_shot_all_reduce_"))


def choose_path(backend: str, cuda: bool, hosts: list, have_ops: bool) -> tuple[str, str]:
    """``(path, reason)``: ``"symm_mem"`` where it can initialize, else the process group's backend."""
    if backend != "nccl":
        return backend, f"process group backend {backend}: symmetric memory needs NCCL on CUDA"
    if not cuda:
        return "nccl", "no CUDA device: symmetric memory needs one"
    if len(set(hosts)) > 1:
        return "nccl", f"ranks on {len(set(hosts))} hosts: symmetric memory needs every rank on one host"
    if not have_ops:
        return "nccl", (f"torch {torch.__version__} has no torch.ops.symm_mem "
                        "one_shot_all_reduce_out/two_shot_all_reduce_")
    return "symm_mem", "NCCL on CUDA, every rank on one host"


def fits(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether ``x`` can take the symmetric-memory path of a buffer of ``max_bytes``."""
    nbytes = x.numel() * x.element_size()
    return (x.dtype in SYMM_DTYPES and x.is_contiguous() and 0 < nbytes <= max_bytes and nbytes % 4 == 0
            and x.data_ptr() % 16 == 0)  # the kernels store vectors of up to 16 bytes into x


class AllReduce:
    """Sum a tensor over the ranks of ``group`` (None: the default group), in place; see the module."""

    def __init__(self, group=None, max_bytes: int = MAX_BYTES, one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES):
        self.group, self.max_bytes, self.one_shot_max_bytes = group, max_bytes, one_shot_max_bytes
        self.size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        hosts = [None] * self.size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        self.path, self.reason = choose_path(backend, torch.cuda.is_available(), hosts, symm_mem_ops())
        self.buffer = None
        if self.path == "symm_mem":
            self._init_symm_mem()
        log.info("all-reduce over %d ranks: %s (%s)", self.size, self.path, self.reason)

    def _init_symm_mem(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        group = self.group or dist.group.WORLD
        self.group_name, self.ops = group.group_name, torch.ops.symm_mem
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, self.group_name)
            ok = 1
        except RuntimeError as e:
            buffer, ok, error = None, 0, (str(e).splitlines() or [type(e).__name__])[0]
        agreed = torch.tensor([ok], dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)  # one path on every rank
        if int(agreed.item()):
            self.buffer = buffer
            self.reason += f"; a {self.max_bytes}-byte symmetric buffer per rank, NCCL above it"
        else:
            self.path = "nccl"
            self.reason = (f"symmetric memory did not initialize on this rank: {error}" if not ok else
                           "symmetric memory did not initialize on another rank")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.buffer is not None and fits(x, self.max_bytes):
            return self.one_shot(x) if x.numel() * x.element_size() <= self.one_shot_max_bytes else self.two_shot(x)
        return self.process_group(x)

    def process_group(self, x: torch.Tensor) -> torch.Tensor:
        """The process group's all-reduce (NCCL, gloo), in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def _staged(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffer is None or not fits(x, self.max_bytes):
            raise ValueError(f"x: a symmetric-memory all-reduce needs the symm_mem path and a contiguous, 16-byte "
                             f"aligned bf16/fp32 tensor of 4..{self.max_bytes} bytes (a multiple of 4); path "
                             f"{self.path}, got {x.dtype} {tuple(x.shape)}")
        flat = x.view(-1)
        buf = self.buffer[:x.numel() * x.element_size()].view(x.dtype)
        buf.copy_(flat)
        return flat, buf

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Copy in, every rank sums every peer's buffer into ``x``."""
        flat, buf = self._staged(x)
        self.ops.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)
        return x

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Copy in, each rank sums its slice and writes it to every peer, copy out."""
        flat, buf = self._staged(x)
        self.ops.two_shot_all_reduce_(buf, "sum", self.group_name)
        flat.copy_(buf)
        return x

    def describe(self) -> dict:
        """The chosen path, for result files and logs."""
        return {"path": self.path, "reason": self.reason, "ranks": self.size,
                "symm_mem_max_bytes": self.max_bytes if self.buffer is not None else 0,
                "one_shot_max_bytes": self.one_shot_max_bytes if self.buffer is not None else 0}
