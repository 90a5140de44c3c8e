"""positions_to_slots: request-local positions to paged-cache slots (torch-only; fused form: topk_slots).

What cannot be mapped is -1, without a host sync: a negative position, one at or past its request's
``seq_lens``, one past the block table, a row whose ``row_to_req`` is outside ``[0, B)``, a negative
block id, and a slot that int32 cannot hold. A block id ``>= NB`` (the cache size is not an input
here) gives a slot ``>= NB * P``, which every reader and writer of ``dsa.kernels`` skips like -1.
"""
import torch

from .common import check_block_size, check_same_device, check_tensor, torch_only

INT32_MAX = 2 ** 31 - 1


def positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size):
    b, mb = block_table.shape
    req = row_to_req.long()[:, None]  # [R, 1]
    req_ok = (req >= 0) & (req < b)
    if b == 0 or mb == 0:
        return torch.full(positions.shape, -1, dtype=torch.int32, device=positions.device)
    req = torch.where(req_ok, req, 0)
    pos = positions.long()  # [R, k]
    page = pos // block_size
    valid = req_ok & (pos >= 0) & (pos < seq_lens.long()[req]) & (page < mb)
    block = block_table.long()[req, page.clamp(0, mb - 1)]
    slots = block * block_size + pos % block_size
    valid &= (block >= 0) & (slots <= INT32_MAX)
    return torch.where(valid, slots, -1).to(torch.int32)


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, row_to_req: torch.Tensor,
                       seq_lens: torch.Tensor, block_size: int, *, backend: str = "auto") -> torch.Tensor:
    """Map request-local positions to slots ``block_table[req, pos // P] * P + pos % P``.

    Args:
        positions: ``[R, k]`` int32, ``-1`` (any negative) for padding.
        block_table: ``[B, MB]`` int32 block ids.
        row_to_req: ``[R]`` int32, the request of each row; outside ``[0, B)`` the row maps nothing.
        seq_lens: ``[B]`` int32, ``S`` of each request.
        block_size: ``P``.

    Returns:
        ``slots [R, k]`` int32; ``-1`` for negative positions, any ``pos >= seq_lens[req]``, any
        ``pos // P >= MB``, rows whose ``row_to_req`` is outside ``[0, B)``, negative block ids and
        slots past int32, so a row never names another request's rows. A block id ``>= NB`` gives
        a slot ``>= NB * P``, which the kernels skip. Empty inputs (R, k, B or MB = 0) are fine.
    """
    torch_only(backend, "positions_to_slots")
    block_size = check_block_size(block_size)
    check_tensor("positions", positions, dtype=torch.int32, shape=2)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
    check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(positions.shape[0],))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(positions=positions, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
    return positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)
