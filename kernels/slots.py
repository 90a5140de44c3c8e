"""positions_to_slots: request-local positions to paged-cache slots (torch-only; fused form: topk_slots)."""
import torch

from .common import check_block_size, check_same_device, check_tensor, torch_only


def positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size):
    req = row_to_req.long()[:, None]  # [R, 1]
    pos = positions.long()  # [R, k]
    page = pos // block_size
    valid = (pos >= 0) & (pos < seq_lens.long()[req]) & (page < block_table.shape[1])
    block = block_table.long()[req, page.clamp(0, block_table.shape[1] - 1)]
    slots = block * block_size + pos % block_size
    return torch.where(valid, slots, -1).to(torch.int32)


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, row_to_req: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int, *, backend: str = "auto") -> torch.Tensor:
    """Map request-local positions to slots ``block_table[req, pos // P] * P + pos % P``.

    Args:
        positions: ``[R, k]`` int32, ``-1`` for padding.
        block_table: ``[B, MB]`` int32.
        row_to_req: ``[R]`` int32, the request of each row.
        seq_lens: ``[B]`` int32, ``S`` of each request.
        block_size: ``P``.

    Returns:
        ``slots [R, k]`` int32; ``-1`` for padding, any ``pos >= seq_lens[req]`` and any
        ``pos // P >= MB``, so a row never names another request's rows.
    """
    torch_only(backend, "positions_to_slots")
    block_size = check_block_size(block_size)
    check_tensor("positions", positions, dtype=torch.int32, shape=2)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
    check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(positions.shape[0],))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(positions=positions, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
    return positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)
