"""Persistent pinned host buffers for the copies every step makes (the plan and the sampling table
up, the sampled ids down).

Pinning a fresh buffer per step (``tensor.pin_memory()``, ``torch.empty(..., pin_memory=True)``)
goes through PyTorch's caching host allocator, which keeps every page-locked block it ever handed
out: with a size that changes from step to step, a server's resident memory grows with the steps it
has run (vLLM found the same: vllm-project/vllm#48165), and each new block is a ``cudaHostAlloc``
that takes a driver-wide lock (vllm-project/vllm#37006). A :class:`PinnedBuffers` hands out a few
buffers in turn instead, each grown (to a power of two) only when a copy needs more room, and
reused only when its holder gave it back and the copy that last used it has finished on the device.
"""
from dataclasses import dataclass

import numpy as np
import torch

MAX_SLOTS = 4  # by default, with this many buffers a taker waits for a given-back one's copy rather than pin another


@dataclass
class Slot:
    """One buffer: ``buffer`` (1-D, pinned on CUDA), ``event`` of the last copy that used it (None:
    none in flight), ``held`` while its taker still reads or writes it."""
    buffer: torch.Tensor
    event: object = None
    held: bool = False


class PinnedBuffers:
    """Host buffers of ``dtype`` for copies to or from ``device`` (pinned when it is a CUDA device).
    :meth:`take` a slot, fill or read ``slot.buffer[:n]``, :meth:`give_back` it; a slot is never
    handed out while held or while the copy recorded at its return may still run."""

    def __init__(self, device, dtype: torch.dtype, event_factory=None, max_slots: int = MAX_SLOTS):
        self.max_slots = max_slots  # buffers in flight before a taker waits (copies a step enqueues)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = dtype
        self.slots: list = []
        self.new_event = event_factory or (torch.cuda.Event if self.cuda else None)

    def take(self, numel: int) -> Slot:
        """A slot whose buffer holds at least ``numel`` elements, held until :meth:`give_back`."""
        free = [s for s in self.slots if not s.held]
        ready = [s for s in free if s.event is None or s.event.query()]
        if ready:
            slot = ready[0]
        elif free and len(self.slots) >= self.max_slots:
            slot = free[0]
            slot.event.synchronize()
        else:
            slot = Slot(self._alloc(numel))
            self.slots.append(slot)
        if slot.buffer.numel() < numel:
            slot.buffer = self._alloc(numel)
        slot.event, slot.held = None, True
        return slot

    def give_back(self, slot: Slot, copied: bool) -> None:
        """Release ``slot``; ``copied``: a copy that uses its buffer was just enqueued on the current
        stream (the slot is handed out again only once that copy has run)."""
        if copied and self.new_event is not None:
            slot.event = self.new_event()
            slot.event.record()
        slot.held = False

    def copy_to(self, array: np.ndarray) -> torch.Tensor:
        """``array`` (of this pool's dtype) on the device: on CUDA one non-blocking copy from a
        buffer of the pool; elsewhere the array's own memory."""
        if not self.cuda:
            return torch.from_numpy(array)
        slot = self.take(array.size)
        host = slot.buffer[:array.size]
        host.numpy()[:] = array.reshape(-1)
        out = host.view(array.shape).to(self.device, non_blocking=True)
        self.give_back(slot, copied=True)
        return out

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(1 << max(6, (numel - 1).bit_length()), dtype=self.dtype, pin_memory=self.cuda)
