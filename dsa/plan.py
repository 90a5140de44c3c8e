"""BatchPlan: everything a step's layers share, built once per step from the requests' lengths.

Rows are the step's new tokens, requests concatenated in order. Each row's function is fixed
by DESIGN section 6: a row whose valid range ``[0, pos]`` exceeds ``index_topk`` attends to its
top-k (sparse); any other row, and every row of a model without an indexer, attends to all of
it (dense). Only among implementations of that function does the plan choose (``Dispatch``).
"""
from dataclasses import dataclass, field

import torch

from .dispatch import Dispatch

PATHS = ("sparse_decode", "dense_decode", "sparse_prefill", "dense_prefill_mha", "dense_prefill_absorbed")


@dataclass
class Segment:
    """Rows ``[row0, row1)`` of request ``req`` (positions ``pos0 ..``), served by one path."""
    req: int
    row0: int
    row1: int
    pos0: int

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def seq_len(self) -> int:
        """Positions visible to the segment's last row, i.e. its context length."""
        return self.pos0 + self.rows


@dataclass
class BatchPlan:
    query_lens: list
    context_lens: list
    block_size: int
    block_table: torch.Tensor  # [B, MB] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    positions: torch.Tensor  # [T] int64, request-local
    slot_mapping: torch.Tensor  # [T] int64, where each row's latent / indexer key is written
    row_to_req: torch.Tensor  # [T] int32
    valid_lens: torch.Tensor  # [T] int32, pos + 1 (causal)
    decode_reqs: list = field(default_factory=list)  # requests with one new token
    prefill_reqs: list = field(default_factory=list)
    segments: dict = field(default_factory=lambda: {p: [] for p in PATHS})
    decode_sparse_kernel: bool = False  # dense decode rows run the sparse kernel with every position

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def row_counts(self) -> dict:
        return {p: sum(s.rows for s in segs) for p, segs in self.segments.items()}

    def rows_of(self, path: str) -> torch.Tensor:
        """int64 row indices of a path's segments, in order."""
        segs = self.segments[path]
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=self.positions.device)
        return torch.cat([torch.arange(s.row0, s.row1, device=self.positions.device) for s in segs])

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size: int, device, *, index_topk: int | None = None,
              dispatch: Dispatch | None = None, mha_kv_bytes_per_token: int = 0) -> "BatchPlan":
        """Plan one step.

        Args:
            query_lens: new tokens per request (``>= 1``); context_lens: tokens already cached.
            block_tables: ``[B, MB]`` int32 tensor or a list of block-id lists (padded with 0).
            block_size: ``P``. index_topk: the model's ``index_topk`` (None: no indexer, all dense).
            dispatch: speed choices between equivalent implementations (None: dense decode kernel,
                absorbed prefill). mha_kv_bytes_per_token: bytes of up-projected K/V per context
                token, to respect the MHA workspace.
        """
        query_lens, context_lens = [int(q) for q in query_lens], [int(c) for c in context_lens]
        if len(query_lens) != len(context_lens):
            raise ValueError(f"context_lens: expected {len(query_lens)} entries (one per request), got {len(context_lens)}")
        if any(q < 1 for q in query_lens) or any(c < 0 for c in context_lens):
            raise ValueError("query_lens: every request needs >= 1 new token and context_lens >= 0")
        if not isinstance(block_tables, torch.Tensor):
            width = max([len(t) for t in block_tables] + [1])
            block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        block_table = block_tables.to(device=device, dtype=torch.int32)
        seq = [c + q for c, q in zip(context_lens, query_lens)]
        if block_table.shape[0] != len(seq) or any(-(-s // block_size) > block_table.shape[1] for s in seq):
            raise ValueError(f"block_tables: expected [B={len(seq)}, >= ceil(S / {block_size})] blocks per request, "
                             f"got {list(block_table.shape)} for seq_lens {seq}")
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]).to(device)
        row_to_req = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(query_lens)).to(device)
        slot_mapping = (block_table.long()[row_to_req, positions // block_size] * block_size
                        + positions % block_size)
        plan = cls(query_lens, context_lens, block_size, block_table, torch.tensor(seq, dtype=torch.int32, device=device),
                   positions, slot_mapping, row_to_req.to(torch.int32), (positions + 1).to(torch.int32))
        limit = index_topk if index_topk is not None else float("inf")
        row = 0
        for b, (c, q) in enumerate(zip(context_lens, query_lens)):
            dense_rows = int(max(0, min(q, limit - c)))  # rows whose range [0, pos] fits in index_topk
            if q == 1:
                plan.decode_reqs.append(b)
                path = "dense_decode" if dense_rows else "sparse_decode"
                plan.segments[path].append(Segment(b, row, row + 1, c))
            else:
                plan.prefill_reqs.append(b)
                if dense_rows:
                    seg = Segment(b, row, row + dense_rows, c)
                    mha = dispatch is not None and dispatch.prefill_uses_mha(
                        seg.rows, seg.seq_len, seg.seq_len * mha_kv_bytes_per_token)
                    plan.segments["dense_prefill_mha" if mha else "dense_prefill_absorbed"].append(seg)
                if dense_rows < q:
                    plan.segments["sparse_prefill"].append(Segment(b, row + dense_rows, row + q, c + dense_rows))
            row += q
        dense_decode = plan.segments["dense_decode"]
        plan.decode_sparse_kernel = bool(dense_decode) and dispatch is not None and all(
            dispatch.decode_uses_sparse_kernel(s.seq_len) for s in dense_decode)
        return plan
