"""Helpers shared by the kernel tests and benchmarks: paged inputs, poisoning, guard regions, comparisons."""
import torch

from dsa.kernels.common import cdiv
from dsa.kernels.slots import positions_to_slots_reference
from dsa.kernels.topk import topk_indices

GUARD_BYTE = 0xFF  # NaN in e4m3, bf16 and fp32: a read of a guard region poisons the result


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2<x,y> / (|x|^2 + |y|^2)`` in float64 (DeepGEMM's measure); 0 for identical tensors."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def topk_agreement(ours: torch.Tensor, theirs: torch.Tensor, lengths: torch.Tensor, k: int,
                   starts: torch.Tensor | None = None) -> dict:
    """How two logits of the same rows (with the same ``-inf`` masks) agree, for a report.

    ``max_abs_diff`` and ``calc_diff`` over the finite entries; the top-k of each row's window
    ``[start, start + length)`` by ``topk_indices``: ``rows_same_topk`` of ``rows`` select the same
    set, ``positions_differing`` in all. A position selected by one and not the other lies within
    ``2 d`` of ``ours``' k-th value, ``d`` the row's largest ``|ours - theirs|`` (the two k-th values
    differ by at most ``d``): ``max_tie_gap`` is the largest such distance over ``d``, so at most 2
    when every difference is a near-tie (0 when no set differs).
    """
    finite = torch.isfinite(ours)
    diff = (ours - theirs)[finite].abs()
    sel_a, sel_b = topk_indices(ours, lengths, k, starts), topk_indices(theirs, lengths, k, starts)
    same = (sel_a.sort(dim=1).values == sel_b.sort(dim=1).values).all(dim=1)
    report = {"max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
              "calc_diff": calc_diff(ours[finite], theirs[finite]), "rows": ours.shape[0],
              "rows_same_topk": int(same.sum()), "positions_differing": 0, "max_tie_gap": 0.0}
    for r in (~same).nonzero().flatten().tolist():
        start = 0 if starts is None else max(0, int(starts[r]))
        row_a, row_b = ours[r, start:start + int(lengths[r])], theirs[r, start:start + int(lengths[r])]
        a, b = set(sel_a[r].tolist()) - {-1}, set(sel_b[r].tolist()) - {-1}
        odd = torch.tensor(sorted(a ^ b), device=ours.device)
        d = float((row_a - row_b)[torch.isfinite(row_a)].abs().max())
        kth = float(row_a[sel_a[r][sel_a[r] >= 0].long()].min())
        gap = float((row_a[odd] - kth).abs().max())
        report["positions_differing"] += len(odd)
        report["max_tie_gap"] = max(report["max_tie_gap"], gap / d if d > 0 else float("inf"))
    return report


def random_block_tables(seq_lens: list[int], block_size: int, *, extra_blocks: int = 0, generator=None,
                        device=None) -> tuple[torch.Tensor, int]:
    """Non-contiguous block tables: each request owns ``ceil(S / P)`` distinct random blocks.

    Returns ``(block_table [B, MB] int32, num_blocks)``; unused table entries are 0 (never read
    for valid positions). ``extra_blocks`` leaves blocks that no request owns.
    """
    need = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    mb = max(need + [1])
    table = torch.zeros(len(seq_lens), mb, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table.to(device), num_blocks


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
    flat[~keep] = 0xFF


def poison_unowned_indexer_rows(cache: torch.Tensor, owned: torch.Tensor, block_size: int) -> None:
    """The same for a planar indexer cache ``uint8 [NB, P * (DI + 4)]``: values and scales."""
    from dsa.kernels.layouts import indexer_cache_views
    k8, scale = indexer_cache_views(cache, block_size)
    keep = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool, device=cache.device)
    keep[owned] = True
    keep = keep.view(cache.shape[0], block_size)
    k8.view(torch.uint8)[~keep] = 0xFF
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
