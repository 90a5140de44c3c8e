"""Helpers only the kernel tests use: the slots a request owns, poisoned unowned cache rows, guard regions."""
import torch

from dsa.kernels.common import cdiv
from dsa.kernels.layouts import indexer_cache_views
from dsa.kernels.slots import positions_to_slots_reference

GUARD_BYTE = 0xFF  # NaN in e4m3, bf16 and fp32: a read of a guard region poisons the result


def owned_slots(block_table: torch.Tensor, seq_lens, block_size: int) -> torch.Tensor:
    """int64 slots of positions ``0 .. S_b - 1`` of every request, concatenated."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int32).to(block_table.device)
    width = int(lens.max()) if len(lens) else 0
    positions = torch.arange(width, dtype=torch.int32, device=block_table.device).expand(len(lens), width)
    slots = positions_to_slots_reference(positions, block_table, torch.arange(len(lens), dtype=torch.int32,
                                         device=block_table.device), lens, block_size)
    return slots[positions < lens[:, None].long()].long()


def poison_unowned_rows(cache: torch.Tensor, owned: torch.Tensor) -> None:
    """Fill every token row of a ``[NB, P, ...]`` cache that ``owned`` (int64 slots) does not name
    with NaN bytes (0xFF: NaN in e4m3, bf16 and fp32), the unwritten tails of owned blocks too."""
    assert cache.is_contiguous()
    flat = cache.view(torch.uint8).view(cache.shape[0] * cache.shape[1], -1)
    keep = torch.zeros(flat.shape[0], dtype=torch.bool, device=cache.device)
    keep[owned] = True
    flat[~keep] = GUARD_BYTE


def poison_unowned_indexer_rows(cache: torch.Tensor, owned: torch.Tensor, block_size: int) -> None:
    """The same for a planar indexer cache ``uint8 [NB, P * (DI + 4)]``: values and scales."""
    k8, scale = indexer_cache_views(cache, block_size)
    keep = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool, device=cache.device)
    keep[owned] = True
    keep = keep.view(cache.shape[0], block_size)
    k8.view(torch.uint8)[~keep] = GUARD_BYTE
    scale.view(torch.int32)[~keep] = -1  # 0xFFFFFFFF: NaN


class Guarded:
    """A tensor allocated inside a larger byte buffer whose ``guard_bytes`` on each side hold ``byte``
    (default :data:`GUARD_BYTE`, NaN): :meth:`intact` tells whether anything wrote outside the tensor,
    and a kernel that reads outside it reads the guard (NaN poisons float results; pick a ``byte`` that
    makes an integer read visible)."""

    def __init__(self, shape, dtype, device, guard_bytes: int, byte: int = GUARD_BYTE):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        self.byte = byte
        self.guard = cdiv(guard_bytes, 16) * 16  # keeps the tensor 16-byte aligned
        self.buffer = torch.full((self.guard + nbytes + self.guard,), byte, dtype=torch.uint8, device=device)
        self.tensor = self.buffer[self.guard:self.guard + nbytes].view(dtype).view(shape)

    def intact(self) -> bool:
        return bool((self.buffer[:self.guard] == self.byte).all() and (self.buffer[-self.guard:] == self.byte).all())
