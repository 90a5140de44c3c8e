"""The checked top-k ops, routed to the torch reference or the Triton launcher, and the warm-up that
compiles every finish tile a server can meet."""
import torch
import triton

from dsa.kernels.common import check_block_size, check_int, check_same_device, check_tensor, resolve_backend

from .launch import bound_widths, finish_tile_shapes, topk_triton
from .reference import topk_indices_reference, topk_slots_reference


def _check_topk_args(logits, lengths, k, starts):
    check_tensor("logits", logits, dtype=torch.float32, shape=2)
    r = logits.shape[0]
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(r,))
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(r,))
    check_int("k", k, minimum=1)
    return check_same_device(logits=logits, lengths=lengths, starts=starts)


def topk_indices(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts: torch.Tensor | None = None, *,
                 backend: str = "auto") -> torch.Tensor:
    """Per row, the ``min(k, length)`` best columns of ``logits[r, start : start + length]``.

    Args:
        logits: ``[R, L]`` float32.
        lengths: ``[R]`` int32, valid columns per row (clipped to ``L - start``; negative: 0).
        k: columns to keep (``index_topk``), an int >= 1 (``k = 0`` is refused).
        starts: ``[R]`` int32 first valid column per row; 0 when None; a negative start is 0.

    Returns:
        ``[R, k]`` int32 positions relative to ``start``, ``-1`` padded at the end of each row.
        A row with ``length <= k`` is exactly ``0, 1, ..., length - 1``. Otherwise the order is
        unspecified and the set is fixed: every selected logit >= every unselected valid one,
        and among logits equal to the k-th largest the lowest positions are selected. Values
        rank by their fp32 bits (+NaN above +inf, -NaN below -inf), so the set is a function
        of the row's window alone: the same at any padding width, in any batch, on any backend.
        Whatever the logits hold, a row holds exactly ``min(k, length)`` distinct in-range
        positions. R = 0 gives ``[0, k]``; L = 0 rows of -1.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    impl = resolve_backend(backend, device, "topk_indices")
    if impl == "torch":
        return topk_indices_reference(logits, lengths, k, starts)
    return topk_triton(logits, lengths, k, starts)


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
        position, ``-1`` for padding and for whatever :func:`positions_to_slots` cannot map
        (positions outside the request or its block table, rows whose ``row_to_req`` is outside
        ``[0, B)``, negative block ids, slots past int32), on both backends.
    """
    device = _check_topk_args(logits, lengths, k, starts)
    block_size = check_block_size(block_size)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2)
    check_tensor("row_to_req", row_to_req, dtype=torch.int32, shape=(logits.shape[0],))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(logits=logits, block_table=block_table, row_to_req=row_to_req, seq_lens=seq_lens)
    impl = resolve_backend(backend, device, "topk_slots", block_size=block_size)
    if impl == "torch":
        return topk_slots_reference(logits, lengths, k, block_table, row_to_req, seq_lens, block_size, starts)
    return topk_triton(logits, lengths, k, starts, (block_table, row_to_req, seq_lens, block_size))


def warm_topk_slots(k: int, max_width: int, max_rows: int, block_size: int, device) -> int:
    """Launch :func:`topk_slots` once per finish tile it can choose up to ``[max_rows, max_width]``
    (:func:`~.launch.finish_tile_shapes`) and, for each tile width of the tile bound that rows up to
    that wide can take (:func:`~.launch.bound_widths`), once more on it with and without ``starts``,
    so a server never compiles one later. Returns the launches."""
    shapes = list(finish_tile_shapes(k, max_width, max_rows).values())
    for rows, width in bound_widths(k, max_width, max_rows).values():
        shapes += [(rows, width, False), (rows, width, True)]
    for rows, width, *with_starts in shapes:
        logits = torch.randn(rows, width, device=device)
        lengths = torch.full((rows,), width, dtype=torch.int32, device=device)
        starts = torch.zeros(rows, dtype=torch.int32, device=device) if with_starts and with_starts[0] else None
        table = torch.zeros(1, triton.cdiv(width, block_size), dtype=torch.int32, device=device)
        topk_slots(logits, lengths, k, table, torch.zeros(rows, dtype=torch.int32, device=device), lengths[:1],
                   block_size, starts)
    return len(shapes)
