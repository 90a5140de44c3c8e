"""What the indexer reads of a step, and what it returns: small typed views built once per step.

The step plan (``dsa.model.plan.BatchPlan``) builds an :class:`IndexerBatch` once; every indexer layer
reads it. Rows are the step's new tokens, requests concatenated in order.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """The step's decode rows (one new token per request), every one served by top-k + sparse MLA.

    ``rows`` indexes the step's rows (a slice when they are contiguous, as in decode-only steps);
    row ``i`` of the views below belongs to the request whose blocks are ``block_table[i]``.
    """
    rows: slice | torch.Tensor  # R rows of the step; a tensor is [R] int64
    block_table: torch.Tensor  # [R, MB] int32
    seq_lens: torch.Tensor  # [R] int32, S of each row's request (0 for a padding row: nothing visible)
    row_ids: torch.Tensor  # [R] int32, arange(R): row i reads block_table[i]
    max_seq_len: int  # host: an upper bound of seq_lens, the width of the paged logits
    every_position: torch.Tensor | None  # [R, K] int32 slots of positions 0 .. K-1 (-1 past S) when max_seq_len <= K


@dataclass(frozen=True)
class PrefillRows:
    """One request's prefill rows whose valid range exceeds ``index_topk`` (scored by ragged logits)."""
    rows: slice  # rows [row0, row1) of the step
    block_table: torch.Tensor  # [1, MB] int32, the request's blocks
    seq_len: torch.Tensor  # [1] int32, positions visible to the last row
    valid_lens: torch.Tensor  # [rows] int32, pos + 1 (causal)
    starts: torch.Tensor  # [rows] int32 zeros


@dataclass(frozen=True)
class IndexerBatch:
    positions: torch.Tensor  # [T] int32, request-local
    slot_mapping: torch.Tensor  # [T] int32, where each row's key is written (-1: nowhere)
    decode: DecodeRows | None
    prefill: tuple  # PrefillRows, in row order


@dataclass(frozen=True)
class Selection:
    """Top-k cache slots of the rows that attend sparsely; layers that skip the indexer reuse it."""
    decode: torch.Tensor | None  # [R, K] int32 for IndexerBatch.decode's rows, -1 padded
    prefill: torch.Tensor | None  # [sum of PrefillRows rows, K] int32, in IndexerBatch.prefill's order
