"""topk_indices and topk_slots: the best ``k`` columns of each row, as positions or as cache slots."""
import torch

from .common import check_block_size, check_same_device, check_tensor, resolve_backend
from .slots import positions_to_slots_reference


def _order_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys that order like the fp32 values (NaN sorts by its bits; its rank is unspecified)."""
    bits = values.float().contiguous().view(torch.int32).long()
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def topk_indices_reference(logits, lengths, k, starts=None):
    r, width = logits.shape
    start = torch.zeros(r, dtype=torch.long, device=logits.device) if starts is None else starts.long()
    length = torch.minimum(lengths.long(), (width - start).clamp_min(0)).clamp_min(0)  # [R]
    cols = torch.arange(width, device=logits.device)
    valid = (cols >= start[:, None]) & (cols < (start + length)[:, None])
    keys = torch.where(valid, _order_key(logits), torch.iinfo(torch.int64).min)  # [R, L]
    slot = torch.arange(k, device=logits.device)
    if width >= k:
        best = keys.topk(k, dim=1).indices - start[:, None]  # [R, k] relative positions
    else:
        best = torch.cat((keys.topk(width, dim=1).indices - start[:, None],
                          torch.zeros(r, k - width, dtype=torch.long, device=logits.device)), dim=1)
    short = (length <= k)[:, None]
    positions = torch.where(short, slot[None, :].expand(r, k), best)  # dense rows: 0, 1, ..., length-1
    return torch.where(slot[None, :] < length[:, None], positions, -1).to(torch.int32)


def _check_topk_args(logits, lengths, k, starts):
    check_tensor("logits", logits, dtype=torch.float32, shape=2)
    r = logits.shape[0]
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(r,))
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(r,))
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: expected a positive int, got {k!r}")
    return check_same_device(logits=logits, lengths=lengths, starts=starts)


def topk_indices(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts: torch.Tensor | None = None, *,
                 backend: str = "auto") -> torch.Tensor:
    """Per row, the ``min(k, length)`` best columns of ``logits[r, start : start + length]``.

    Args:
        logits: ``[R, L]`` float32.
        lengths: ``[R]`` int32, valid columns per row (clipped to ``L - start``).
        k: columns to keep (``index_topk``).
        starts: ``[R]`` int32 first valid column per row; 0 when None.

    Returns:
        ``[R, k]`` int32 positions relative to ``start``, ``-1`` padded at the end of each row.
        A row with ``length <= k`` is exactly ``0, 1, ..., length - 1``. Otherwise the order is
        unspecified and the set is a valid top-k: every selected logit >= every unselected
        valid one (ties either way). Whatever the logits hold (NaN, inf), a row holds
        exactly ``min(k, length)`` distinct in-range positions.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    impl = resolve_backend(backend, device, "topk_indices", kernel_ready=False, issue=4)
    if impl == "torch":
        return topk_indices_reference(logits, lengths, k, starts)


def topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts=None):
    positions = topk_indices_reference(logits, lengths, k, starts)
    return positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)


def topk_slots(logits: torch.Tensor, lengths: torch.Tensor, k: int, block_table: torch.Tensor,
               row_to_req: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
               starts: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """:func:`topk_indices` written straight as cache slots (``positions_to_slots`` fused).

    Args:
        logits, lengths, k, starts: as :func:`topk_indices`.
        block_table: ``[B, MB]`` int32; row_to_req: ``[R]`` int32; seq_lens: ``[B]`` int32.
        block_size: ``P``.

    Returns:
        ``slots [R, k]`` int32: ``block_table[req, pos // P] * P + pos % P`` for each selected
        position, ``-1`` for padding and for positions outside the request or its block table.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    block_size = check_block_size(block_size)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
    check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(logits.shape[0],))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(logits=logits, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
    impl = resolve_backend(backend, device, "topk_slots", kernel_ready=False, issue=4, block_size=block_size)
    if impl == "torch":
        return topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts)
