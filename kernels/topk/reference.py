"""The torch reference of the top-k, and the order every backend ranks values by."""
import torch

from dsa.kernels.slots import positions_to_slots_reference


def order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[-2**31, 2**31)`` that order like the fp32 values; NaN ranks by its bits
    (+NaN above +inf, -NaN below -inf)."""
    bits = values.float().contiguous().view(torch.int32).long()
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _rank_key(values: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys ``[R, L]`` that order like ``order_key`` with ties broken by column, the
    lowest column ranking highest: ``key * 2**31 + (2**31 - 1 - column)`` (columns < 2**31)."""
    cols = torch.arange(values.shape[-1], device=values.device)
    return order_key(values) * (1 << 31) + ((1 << 31) - 1 - cols)


def topk_indices_reference(logits, lengths, k, starts=None):
    """Per row, the positions of the ``min(k, length)`` largest values of its window
    ``logits[r, start : start + length]`` (a negative ``start`` counts as 0, a negative ``length``
    as 0, ``length`` clipped to the row end), ranked by
    ``(order_key(value), -column)``: the k-th largest value's ties go to the lowest positions.

    Rows with ``length <= k`` are ``0 .. length - 1`` in order; longer rows in descending rank;
    ``-1`` pads every row to ``k``. The keys are distinct, so ``torch.topk`` has no ties to break.
    """
    r, width = logits.shape
    start = torch.zeros(r, dtype=torch.long, device=logits.device) if starts is None else starts.long().clamp_min(0)
    length = torch.minimum(lengths.long(), (width - start).clamp_min(0)).clamp_min(0)  # [R]
    cols = torch.arange(width, device=logits.device)
    valid = (cols >= start[:, None]) & (cols < (start + length)[:, None])
    keys = torch.where(valid, _rank_key(logits), torch.iinfo(torch.int64).min)  # [R, L], distinct where valid
    slot = torch.arange(k, device=logits.device)
    if width >= k:
        best = keys.topk(k, dim=1).indices - start[:, None]  # [R, k] relative positions
    else:
        best = torch.cat((keys.topk(width, dim=1).indices - start[:, None],
                          torch.zeros(r, k - width, dtype=torch.long, device=logits.device)), dim=1)
    short = (length <= k)[:, None]
    positions = torch.where(short, slot[None, :].expand(r, k), best)  # dense rows: 0, 1, ..., length-1
    return torch.where(slot[None, :] < length[:, None], positions, -1).to(torch.int32)


def topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts=None):
    positions = topk_indices_reference(logits, lengths, k, starts)
    return positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)
