"""What the indexer reads of a step, and what it returns: small typed views built once per step.

The step plan (``dsa.model.plan.BatchPlan``) builds an :class:`IndexerBatch` once; every indexer layer
reads it. Rows are the step's new tokens, requests concatenated in order.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """The step's decode rows, ``N`` (next_n) per request: one new token each in plain decode, a
    verify step's N + 1 rows (padded in front: ``dsa.model.plan``); with an indexer served by top-k +
    sparse MLA, without one by the dense absorbed decode. Row ``j`` of a request of ``S`` tokens
    sees positions ``[0, S - N + j]``.

    ``rows`` indexes the step's rows (a slice when they are contiguous, as in decode-only steps);
    row ``b * N + j`` of the views below belongs to the request whose blocks are ``block_table[b]``.
    """
    rows: slice | torch.Tensor  # R * N rows of the step; a tensor is [R * N] int64
    block_table: torch.Tensor  # [R, MB] int32
    seq_lens: torch.Tensor  # [R] int32, S of each request (0 for a padding request: nothing visible)
    row_ids: torch.Tensor  # [R * N] int32, b for row b * N + j: the row reads block_table[b]
    max_seq_len: int  # host: an upper bound of seq_lens, the width of the paged logits
    next_n: int  # host: N, rows per request
    lengths: torch.Tensor  # [R * N] int32, positions each row sees: max(0, S - N + j + 1) (N = 1: seq_lens)


@dataclass(frozen=True)
class Segment:
    """One request's prefill rows ``[row0, row1)`` of the step, at positions ``pos0 ..``, all on one
    path: host ints, as the plan routes them before any tensor exists."""
    req: int  # the request's index in the step
    row0: int
    row1: int
    pos0: int  # the position of row0

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row1)

    @property
    def num_rows(self) -> int:
        return self.row1 - self.row0

    @property
    def num_keys(self) -> int:
        """Positions visible to the last row."""
        return self.pos0 + self.num_rows


@dataclass(frozen=True)
class PrefillRows(Segment):
    """A :class:`Segment` with its views on the device: the indexer's sparse rows (scored by ragged
    logits over the request's keys) and the attention's dense segments (rows whose range fits in
    ``index_topk``) are both of this type. Host ints size everything, so no op reads a length back
    from the device."""
    block_table: torch.Tensor  # [1, MB] int32, the request's blocks
    seq_len: torch.Tensor  # [1] int32, pos0 + rows: positions visible to the last row
    valid_lens: torch.Tensor  # [rows] int32, position + 1 of each row (causal)
    slots: torch.Tensor | None = None  # [num_keys] int32 slots of positions 0 .. num_keys - 1 (the MHA path)


@dataclass(frozen=True)
class IndexerBatch:
    positions: torch.Tensor  # [T] int32, request-local
    slot_mapping: torch.Tensor  # [T] int32, where each row's key is written (-1: nowhere)
    decode: DecodeRows | None  # the decode rows to score (None: no decode rows, or every_position is their top-k)
    every_position: torch.Tensor | None  # [R * N, K] int32 slots of positions 0 .. K-1 (-1 past each row's): the decode
    # rows' top-k when every context of the step fits in K (the plan's Route.every_position)
    prefill: tuple  # PrefillRows of the sparse prefill rows, in row order
    zeros: torch.Tensor | None  # [T] int32 zeros, ragged logits' range starts (None: no sparse or MHA prefill rows)


@dataclass(frozen=True)
class Selection:
    """Top-k cache slots of the rows that attend sparsely; layers that skip the indexer reuse it."""
    decode: torch.Tensor | None  # [R, K] int32 for IndexerBatch.decode's rows, -1 padded
    prefill: torch.Tensor | None  # [sum of PrefillRows rows, K] int32, in IndexerBatch.prefill's order
