"""BatchPlan: everything a step's layers read, built once per step.

Rows are the step's new tokens, requests concatenated in order. A row's function is fixed by its
own valid range ``[0, pos]``: one that exceeds ``index_topk`` attends to its top-k (sparse); any
other row, and every row of a model without an indexer, attends to all of it (dense). The plan
chooses only among implementations of that function:

- decode rows (a request with one new token) of a model with an indexer all go through top-k +
  sparse MLA; a row whose context fits in ``index_topk`` gets every position from the top-k (the
  same function as dense attention), so a row's path never depends on the rest of its batch;
  without an indexer they take the dense absorbed decode;
- dense prefill rows take up-projected MHA (SDPA) or the absorbed kernel (``Dispatch``).

The host facts (lengths, block ids, token ids) are packed into one int32 buffer and copied to the
device in one transfer (pinned, non-blocking; an engine's runner packs into persistent pinned
buffers, :mod:`dsa.model.staging`); every tensor of the plan is a view of it or is
derived from it on the device, so building a plan never waits for the device. A decode-only plan
can be padded to a bucket of rows and written into a fixed buffer (``out``): the tensors a CUDA
graph captured are then refilled in place.
"""
from dataclasses import dataclass

import numpy as np
import torch

from dsa.indexer.batch import DecodeRows, IndexerBatch, PrefillRows
from dsa.kernels import positions_to_slots
from dsa.kernels.common import cdiv
from dsa.model.dispatch import Dispatch

# rows served per path (engine statistics), named by the kernels that run them: with an indexer
# every decode row runs top-k + the sparse kernel (a short row's top-k is every position); without
# one, the dense absorbed kernel. Prefill rows whose range fits in index_topk run dense.
PATHS = ("sparse_decode", "dense_decode", "sparse_prefill", "dense_prefill_mha", "dense_prefill_absorbed")


class _Packer:
    """Host int32 arrays packed into one buffer; ``upload`` copies it once and returns device views."""

    def __init__(self):
        self.parts, self.size = [], 0

    def add(self, array, shape=None) -> tuple:
        a = np.ascontiguousarray(array, dtype=np.int32).reshape(-1)
        self.parts.append(a)
        self.size += a.size
        return self.size - a.size, a.size if shape is None else shape

    def upload(self, device, out: torch.Tensor | None = None, staging=None) -> torch.Tensor:
        if out is not None and out.numel() < self.size:
            raise ValueError(f"out: the plan needs {self.size} int32 entries, the buffer holds {out.numel()}")
        slot = None
        if staging is not None and (device.type == "cuda" or out is not None):  # (on CPU, without out the
            # plan's tensors are views of the host array, which a staging buffer reused next step cannot be)
            slot = staging.take(self.size)
            host = slot.buffer[:self.size]
            if self.parts:
                np.concatenate(self.parts, out=host.numpy())
        else:
            host = torch.from_numpy(np.concatenate(self.parts) if self.parts else np.zeros(0, np.int32))
            if device.type == "cuda":
                host = host.pin_memory()
        if out is None:
            out = host.to(device, non_blocking=True)
        else:
            out[:self.size].copy_(host, non_blocking=True)
        if slot is not None:
            staging.give_back(slot, copied=True)
        return out


def _view(buf: torch.Tensor, spec: tuple) -> torch.Tensor:
    offset, shape = spec
    n = int(np.prod(shape))
    return buf[offset:offset + n].view(shape)


def _block_array(block_tables, batch: int, width: int | None) -> np.ndarray:
    """``[batch, width]`` int32 block tables (width: the longest row, or a graph bucket's: columns
    past it are never read, S <= width * P), from a 2-D array or one sequence per request."""
    if isinstance(block_tables, (torch.Tensor, np.ndarray)):
        tables = block_tables.detach().cpu().numpy() if isinstance(block_tables, torch.Tensor) else block_tables
        if tables.ndim != 2 or tables.shape[0] != batch:
            raise ValueError(f"block_tables: expected [B={batch}, MB], got {list(tables.shape)}")
        width = max(tables.shape[1], 1) if width is None else width
        out = tables[:, :width].astype(np.int32, copy=False)
        return np.pad(out, ((0, 0), (0, width - out.shape[1]))) if out.shape[1] < width else out
    rows = [t if isinstance(t, np.ndarray) else np.asarray(t, dtype=np.int64).reshape(-1) for t in block_tables]
    if len(rows) != batch:
        raise ValueError(f"block_tables: expected {batch} rows (one per request), got {len(rows)}")
    width = width if width is not None else max([len(r) for r in rows] + [1])
    out = np.zeros((batch, width), dtype=np.int32)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        out[i, :n] = r[:n]
    return out


@dataclass
class BatchPlan:
    """One step's plan on the device: the rows (``T`` new tokens of ``B`` requests, concatenated),
    where each row's latent row and indexer key go, each request's block table and length, the
    rows each path serves, and the typed views the indexer reads. Built once per step by
    :meth:`build` (or derived from a graph's buffer) and read by every layer; never synced."""
    query_lens: tuple  # host: new tokens per request
    context_lens: tuple  # host: tokens already cached per request
    block_size: int
    max_seq_len: int  # host: an upper bound of seq_lens
    input_ids: torch.Tensor | None  # [T] int32 (when built with ids)
    positions: torch.Tensor  # [T] int32, request-local
    slot_mapping: torch.Tensor  # [T] int32, where each row's latent row and indexer key go (-1: nowhere)
    row_to_req: torch.Tensor  # [T] int32
    block_table: torch.Tensor  # [B, MB] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    logits_rows: torch.Tensor  # [B] int64, each request's last row
    indexer: IndexerBatch  # what the indexer layers read
    decode: DecodeRows | None  # the decode rows (also indexer.decode)
    sparse_prefill_rows: torch.Tensor | None  # [rows] int64 rows of indexer.prefill, in order
    mha: tuple  # PrefillRows: dense prefill rows through up-projected MHA
    absorbed: tuple  # PrefillRows: dense prefill rows through the absorbed kernel
    rows: dict  # host: rows per PATHS entry
    workspace_bytes: int  # host: the largest MHA workspace of the step

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.decode is not None and isinstance(self.decode.rows, slice) and \
            self.decode.rows.stop - self.decode.rows.start == self.num_tokens

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size: int, device, *, out: torch.Tensor | None = None,
              **options) -> "BatchPlan":
        """Plan one step: :meth:`HostPlan.pack` (host), one upload, :meth:`HostPlan.derive` (device).

        ``out``: an int32 device buffer to build the plan in. Other keywords: :meth:`HostPlan.pack`.
        """
        host = HostPlan.pack(query_lens, context_lens, block_tables, block_size, device, **options)
        return host.derive(host.upload(out))


@dataclass
class HostPlan:
    """A step's routing and packed int32 facts on the host; ``derive`` makes the device plan.

    A CUDA graph captures ``derive`` and the layers; each replay packs a new HostPlan of the same
    ``spec`` (the same bucket), uploads it into the captured buffer and replays.
    """
    query_lens: np.ndarray  # [B'] new tokens per request, padding rows included
    context_lens: np.ndarray  # [B'] tokens already cached per request
    num_requests: int  # B: requests before the padding rows
    block_size: int
    index_topk: int | None
    max_seq_len: int
    device: torch.device
    decode_reqs: list
    contiguous: bool  # decode rows are rows 0 .. R-1
    dense_segs: list  # (req, row0, row1, pos0, mha)
    sparse_segs: list  # (req, row0, row1, pos0)
    rows: dict
    workspace_bytes: int
    spec: dict  # name -> (offset, shape) in the packed buffer
    packer: _Packer

    @classmethod
    def pack(cls, query_lens, context_lens, block_tables, block_size: int, device, *, index_topk: int | None = None,
             dispatch: Dispatch | None = None, mha_kv_bytes_per_token: int = 0, input_ids=None,
             input_src=None, num_rows: int | None = None, max_seq_len: int | None = None,
             num_block_columns: int | None = None) -> "HostPlan":
        """Route the rows and pack the step's facts; no device work.

        Args:
            query_lens: new tokens per request (``>= 1``); context_lens: tokens already cached.
            block_tables: ``[B, MB]`` int tensor/array, or one sequence of block ids per request.
            block_size: ``P``. index_topk: the model's ``index_topk`` (None: no indexer, all dense).
            dispatch: speed choices between equivalent prefill implementations (None: absorbed).
            mha_kv_bytes_per_token: bytes of up-projected K/V per context token (the MHA workspace).
            input_ids: ``[T]`` token ids to upload with the plan (``plan.input_ids``), or None.
            input_src: with ``input_ids``, ``[T]`` ints: for a row whose id is still being sampled
                by the step before (overlapped scheduling), that step's row to read it from; -1:
                the id is in ``input_ids`` (None: all -1). Packed as ``src`` (:meth:`view`); the
                runner copies those ids on the device before the step runs.
            num_rows, max_seq_len, num_block_columns: a decode-only plan padded to ``num_rows``
                requests (padding rows see nothing and write nowhere), with the paged-logits width
                ``max_seq_len`` and block tables ``num_block_columns`` wide: a CUDA graph bucket.
        """
        device = torch.device(device)
        q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        c = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        if q.shape != c.shape:
            raise ValueError(f"context_lens: expected {len(q)} entries (one per request), got {len(c)}")
        if (q < 1).any() or (c < 0).any():
            raise ValueError("query_lens: every request needs >= 1 new token and context_lens >= 0")
        seq = c + q
        tables = _block_array(block_tables, len(q), num_block_columns)
        need = cdiv(seq, block_size)
        if (need > tables.shape[1]).any():
            raise ValueError(f"block_tables: expected [B={len(q)}, >= ceil(S / {block_size})] blocks per request, "
                             f"got {list(tables.shape)} for seq_lens {seq.tolist()}")
        longest = int(seq.max()) if len(seq) else 0
        if max_seq_len is not None and max_seq_len < longest:
            raise ValueError(f"max_seq_len: expected >= the longest request ({longest}), got {max_seq_len}")
        max_seq_len = longest if max_seq_len is None else max_seq_len
        real = len(q)
        ids = None
        if input_ids is not None:
            ids = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
            ids = np.asarray(ids).reshape(-1)
            if ids.shape[0] != int(q.sum()):
                raise ValueError(f"input_ids: expected {int(q.sum())} ids (one per new token), got {ids.shape[0]}")
            src = np.full(ids.shape[0], -1) if input_src is None else np.asarray(input_src).reshape(-1)
        if num_rows is not None:
            if (q != 1).any() or num_rows < real:
                raise ValueError(f"num_rows: padding needs a decode-only step of <= {num_rows} requests")
            pad = num_rows - real
            q, c = np.concatenate((q, np.ones(pad, np.int64))), np.concatenate((c, np.zeros(pad, np.int64)))
            seq = np.concatenate((seq, np.zeros(pad, np.int64)))  # padding rows: nothing visible
            tables = np.concatenate((tables, np.zeros((pad, tables.shape[1]), tables.dtype)))
            if ids is not None:
                ids, src = np.concatenate((ids, np.zeros(pad, ids.dtype))), np.concatenate((src, np.full(pad, -1)))
        b, t = len(q), int(q.sum())
        row_to_req = np.repeat(np.arange(b), q)
        first_row = np.cumsum(q) - q
        positions = np.arange(t) - first_row[row_to_req] + c[row_to_req]

        # routing: decode rows, then per prefill request its dense rows and its sparse rows
        limit = index_topk if index_topk is not None else np.iinfo(np.int64).max
        rows = {p: 0 for p in PATHS}
        is_decode = q[:real] == 1
        decode_reqs = np.flatnonzero(is_decode).tolist()
        rows["sparse_decode" if index_topk is not None else "dense_decode"] = len(decode_reqs)
        dense_segs, sparse_segs, workspace = [], [], 0
        for i in np.flatnonzero(~is_decode).tolist():
            dense = int(max(0, min(q[i], limit - c[i])))  # rows whose range [0, pos] fits in index_topk
            if dense:
                s = int(c[i]) + dense
                mha = dispatch is not None and dispatch.prefill_uses_mha(dense, s, s * mha_kv_bytes_per_token)
                dense_segs.append((i, int(first_row[i]), int(first_row[i]) + dense, int(c[i]), mha))
                rows["dense_prefill_mha" if mha else "dense_prefill_absorbed"] += dense
                workspace = max(workspace, s * mha_kv_bytes_per_token if mha else 0)
            if dense < q[i]:
                sparse_segs.append((i, int(first_row[i]) + dense, int(first_row[i] + q[i]), int(c[i]) + dense))
                rows["sparse_prefill"] += int(q[i]) - dense
        decode_reqs += list(range(real, b))  # padding rows are decode rows too

        pack = _Packer()
        spec = dict(positions=pack.add(positions), row_to_req=pack.add(row_to_req), valid=pack.add(positions + 1),
                    zeros=pack.add(np.zeros(t)), seq_lens=pack.add(seq), table=pack.add(tables, tables.shape),
                    logits_rows=pack.add(first_row + q - 1))
        if ids is not None:
            spec["ids"], spec["src"] = pack.add(ids), pack.add(src)
        contiguous = decode_reqs == list(range(len(decode_reqs)))
        if decode_reqs and not contiguous:
            spec["decode_rows"] = pack.add(first_row[decode_reqs])
            spec["decode_reqs"] = pack.add(decode_reqs)
        if dense_segs:  # each dense segment's own context: its last row's position + 1
            spec["dense_seq"] = pack.add([pos0 + r1 - r0 for _, r0, r1, pos0, _ in dense_segs])
        sparse_rows = [r for _, r0, r1, _ in sparse_segs for r in range(r0, r1)]
        if sparse_rows:
            spec["sparse_rows"] = pack.add(sparse_rows)
        return cls(q, c, real, block_size, index_topk, max_seq_len, device, decode_reqs, contiguous, dense_segs,
                   sparse_segs, rows, workspace, spec, pack)

    def upload(self, out: torch.Tensor | None = None, staging=None) -> torch.Tensor:
        """The packed facts on the device: one non-blocking copy (into ``out`` when given), from a
        buffer of ``staging`` (a :class:`~dsa.model.staging.PinnedBuffers` of int32) when given, else
        from one pinned for this copy."""
        return self.packer.upload(self.device, out, staging)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """One packed entry (``ids``, ``src``, ``positions``, ...) of the uploaded buffer."""
        return _view(buf, self.spec[name])

    def derive(self, buf: torch.Tensor) -> BatchPlan:
        """The device plan from the uploaded buffer: views, slots, per-path rows (no host sync)."""
        spec, device, block_size = self.spec, self.device, self.block_size
        block_table, seq_lens = _view(buf, spec["table"]), _view(buf, spec["seq_lens"])
        row_to_req, positions = _view(buf, spec["row_to_req"]), _view(buf, spec["positions"])
        slot_mapping = positions_to_slots(positions[:, None], block_table, row_to_req, seq_lens, block_size)[:, 0]
        decode = None
        if self.decode_reqs:
            r = len(self.decode_reqs)
            row_ids = torch.arange(r, dtype=torch.int32, device=device)
            if self.contiguous:
                d_rows, d_table, d_lens = slice(0, r), block_table[:r], seq_lens[:r]
            else:
                reqs = _view(buf, spec["decode_reqs"]).long()
                d_rows, d_table, d_lens = _view(buf, spec["decode_rows"]).long(), block_table[reqs], seq_lens[reqs]
            every = None
            if self.index_topk is not None and self.max_seq_len <= self.index_topk:  # top-k returns every position
                every = positions_to_slots(torch.arange(self.index_topk, dtype=torch.int32, device=device)
                                           .expand(r, -1), d_table, row_ids, d_lens, block_size)
            decode = DecodeRows(d_rows, d_table, d_lens, row_ids, self.max_seq_len, every)
        valid, zeros = _view(buf, spec["valid"]), _view(buf, spec["zeros"])
        prefill = tuple(PrefillRows(i, r0, r1, pos0, block_table[i:i + 1], seq_lens[i:i + 1], valid[r0:r1])
                        for i, r0, r1, pos0 in self.sparse_segs)
        mha, absorbed = [], []
        dense_seq = _view(buf, spec["dense_seq"]) if self.dense_segs else None
        for j, (i, r0, r1, pos0, use_mha) in enumerate(self.dense_segs):
            seq_len, slots = dense_seq[j:j + 1], None
            if use_mha:
                slots = positions_to_slots(torch.arange(pos0 + r1 - r0, dtype=torch.int32, device=device)[None],
                                           block_table[i:i + 1], zeros[:1], seq_len, block_size)[0]
            (mha if use_mha else absorbed).append(PrefillRows(i, r0, r1, pos0, block_table[i:i + 1], seq_len,
                                                              valid[r0:r1], slots))
        b = self.num_requests
        return BatchPlan(tuple(int(v) for v in self.query_lens[:b]), tuple(int(v) for v in self.context_lens[:b]),
                         block_size, self.max_seq_len, _view(buf, spec["ids"]) if "ids" in spec else None, positions,
                         slot_mapping, row_to_req, block_table, seq_lens, _view(buf, spec["logits_rows"]).long(),
                         IndexerBatch(positions, slot_mapping, decode, prefill, zeros), decode,
                         _view(buf, spec["sparse_rows"]).long() if "sparse_rows" in spec else None, tuple(mha),
                         tuple(absorbed), dict(self.rows), self.workspace_bytes)
