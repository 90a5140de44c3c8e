"""BatchPlan: everything a step's layers read, built once per step.

:meth:`HostPlan.pack` checks the step's lengths, pads a decode-only step to a CUDA graph bucket,
routes the rows (:func:`dsa.model.route.route`: which implementation serves each) and packs the
host facts (lengths, block ids, token ids) into one int32 buffer, copied to the device in one
transfer (pinned, non-blocking; an engine's runner packs into persistent pinned buffers,
:mod:`dsa.engine.staging`). :meth:`HostPlan.derive` makes the device plan: every tensor of it is a
view of that buffer or is derived from it on the device, so building a plan never waits for the
device. A padded plan can be written into a fixed buffer (``out``): the tensors a CUDA graph
captured are then refilled in place.

Decode requests have ``next_n`` rows each (DESIGN's ``N``): 1 in plain decode; in a verify step of
speculative decoding N + 1, and every request of at most ``next_n`` new tokens decodes, its rows
padded in front to ``next_n``. Row ``j`` of a decode request of ``S`` tokens sits at position
``S - next_n + j`` and sees ``[0, S - next_n + j]`` (the decode kernels' causal rule), so its new
tokens sit at their own positions, and the padding rows in front of them see only positions cached
before the step and write nowhere (``row_to_req`` -1); nothing returns their outputs.
:attr:`HostPlan.row_index` maps the rows given to the plan's.

A step padded to a graph bucket packs by its own path (``HostPlan._decode``): its layout is fixed per bucket
and row count (cached: :func:`_decode_facts`) and its values are each request's length, table row, ids and
src, written into a copy of the bucket's template by a few whole-array ops; the bytes are the general path's.
"""
import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import torch

from dsa.indexer.batch import DecodeRows, IndexerBatch, PrefillRows, Segment
from dsa.kernels import positions_to_slots
from dsa.kernels.common import cdiv, check_int
from dsa.model.route import PATHS, Bucket, PlanOptions, Route, decode_route, graph_bucket, route

__all__ = ["PATHS", "BatchPlan", "Bucket", "HostPlan", "PlanOptions"]


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
            (out if out.numel() == self.size else out[:self.size]).copy_(host, non_blocking=True)
        if slot is not None:
            staging.give_back(slot, copied=True)
        return out


def _view(buf: torch.Tensor, spec: tuple) -> torch.Tensor:
    offset, shape = spec
    n = int(np.prod(shape))
    return buf[offset:offset + n].view(shape)


def _block_array(block_tables, batch: int, width: int | None, num_rows: int) -> np.ndarray:
    """``[num_rows, width]`` int32 block tables (width: the longest row, or a graph bucket's: columns
    past it are never read, S <= width * P; rows past ``batch``: padding, zeros), from a 2-D array
    or one sequence per request."""
    if isinstance(block_tables, (torch.Tensor, np.ndarray)):
        tables = block_tables.detach().cpu().numpy() if isinstance(block_tables, torch.Tensor) else block_tables
        if tables.ndim != 2 or tables.shape[0] != batch:
            raise ValueError(f"block_tables: expected [B={batch}, MB], got {list(tables.shape)}")
        width = max(tables.shape[1], 1) if width is None else width
        if num_rows == batch and tables.shape[1] >= width:
            return tables[:, :width].astype(np.int32, copy=False)
        out = np.zeros((num_rows, width), dtype=np.int32)
        n = min(tables.shape[1], width)
        out[:batch, :n] = tables[:, :n]
        return out
    rows = [t if isinstance(t, np.ndarray) else np.asarray(t, dtype=np.int64).reshape(-1) for t in block_tables]
    if len(rows) != batch:
        raise ValueError(f"block_tables: expected {batch} rows (one per request), got {len(rows)}")
    width = width if width is not None else max([len(r) for r in rows] + [1])
    out = np.zeros((num_rows, width), dtype=np.int32)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        out[i, :n] = r[:n]
    return out


def _check_lengths(query_lens, context_lens) -> tuple[np.ndarray, np.ndarray]:
    query = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    context = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    if query.shape != context.shape:
        raise ValueError(f"context_lens: expected {len(query)} entries (one per request), got {len(context)}")
    if query.min(initial=1) < 1 or context.min(initial=0) < 0:
        raise ValueError("query_lens: every request needs >= 1 new token and context_lens >= 0")
    return query, context


def _check_ids(input_ids, input_src, num_tokens: int):
    """``(ids, src)`` host arrays of ``[T]`` (None, None without ids)."""
    if input_ids is None:
        return None, None
    ids = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
    ids = np.asarray(ids).reshape(-1)
    if ids.shape[0] != num_tokens:
        raise ValueError(f"input_ids: expected {num_tokens} ids (one per new token), got {ids.shape[0]}")
    src = np.full(num_tokens, -1) if input_src is None else np.asarray(input_src).reshape(-1)
    if src.shape[0] != num_tokens:
        raise ValueError(f"input_src: expected {num_tokens} entries (one per new token), got {src.shape[0]}")
    return ids, src


def _choose_bucket(query: np.ndarray, longest: int, block_size: int, bucket: Bucket | None,
                   graphs: bool, next_n: int) -> Bucket | None:
    """The bucket to pad to: the one given (checked), the step's own with ``graphs``, else None."""
    if graphs:
        if bucket is not None:
            raise ValueError("bucket: give a bucket or graphs=True, not both")
        return graph_bucket(query, longest, block_size, next_n)
    if bucket is None:
        return None
    if not isinstance(bucket, Bucket):
        raise TypeError(f"bucket: expected a Bucket, got {type(bucket).__name__}")
    if bucket.next_n != next_n:
        raise ValueError(f"bucket: its next_n {bucket.next_n} is not the step's next_n {next_n}")
    if query.max(initial=0) > next_n or bucket.rows < len(query):
        raise ValueError(f"bucket: padding needs a decode-only step of <= {bucket.rows} requests of <= {next_n} "
                         f"new tokens, got query_lens {query.tolist()}")
    if bucket.max_seq_len < longest:
        raise ValueError(f"bucket: max_seq_len must be >= the longest request ({longest}), got {bucket.max_seq_len}")
    return bucket


@dataclass
class _Layout:
    """The plan's rows (module docstring): each decode request's rows padded in front to ``next_n``,
    then the padding requests (``next_n`` rows at positions ``0 ..``, nothing visible: S = 0)."""
    query: np.ndarray  # [B'] rows per request
    start: np.ndarray  # [B'] the position of each request's first row
    seq: np.ndarray  # [B'] S: tokens cached after the step (0: a padding request)
    new: np.ndarray  # [B'] the request's own new tokens (0: a padding request)
    first_row: np.ndarray  # [B'] each request's first row
    row_index: np.ndarray  # [T] int64, the plan row of each row given
    num_tokens: int  # T': rows of the plan

    @classmethod
    def of(cls, query, context, seq, next_n: int, num_rows: int) -> "_Layout":
        pad = np.zeros(num_rows - len(query), np.int64)
        new, seq, context = (np.concatenate((a, pad)) for a in (query, seq, context))
        decode = new <= next_n
        rows = np.where(decode, next_n, new)
        start = np.where(decode & (seq > 0), seq - rows, context)  # padding requests: positions 0 ..
        first_row = np.cumsum(rows) - rows
        req = np.repeat(np.arange(len(query)), query)  # the given rows' requests
        given_first = np.cumsum(query) - query
        row_index = first_row[req] + (rows - new)[req] + np.arange(len(req)) - given_first[req]
        return cls(rows, start, seq, new, first_row, row_index, int(rows.sum()))

    def scatter(self, values, fill):
        """``values [T]`` of the given rows at their plan rows, ``fill`` elsewhere."""
        out = np.full(self.num_tokens, fill, dtype=np.asarray(values).dtype)
        out[self.row_index] = values
        return out


@dataclass
class BatchPlan:
    """One step's plan on the device: the rows (``T`` new tokens of ``B`` requests, concatenated),
    where each row's latent row and indexer key go, each request's block table and length, how the
    rows are routed, and the typed views the indexer reads. Built once per step by :meth:`build`
    (or derived from a graph's buffer) and read by every layer; never synced."""
    query_lens: tuple  # host: new tokens per request
    context_lens: tuple  # host: tokens already cached per request
    block_size: int
    max_seq_len: int  # host: an upper bound of seq_lens
    route: Route  # host: which path serves which rows (flags, segments, rows per path, MHA workspace)
    input_ids: torch.Tensor | None  # [T] int32 (when built with ids)
    positions: torch.Tensor  # [T] int32, request-local
    slot_mapping: torch.Tensor  # [T] int32, where each row's latent row and indexer key go (-1: nowhere)
    row_to_req: torch.Tensor  # [T] int32, -1 for a padding row of a decode request (it writes nowhere)
    block_table: torch.Tensor  # [B, MB] int32
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    logits_rows: torch.Tensor  # [R] int32, the rows whose logits the step returns (default: each request's last)
    indexer: IndexerBatch  # what the indexer layers read
    decode: DecodeRows | None  # the decode rows (route.decode_reqs)
    sparse_prefill_rows: torch.Tensor | None  # [rows] int64 rows of indexer.prefill, in order
    mha: tuple  # PrefillRows: dense prefill rows through up-projected MHA (route.mha)
    absorbed: tuple  # PrefillRows: dense prefill rows through the absorbed kernel (route.absorbed)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size: int, device, *,
              options: PlanOptions = PlanOptions(), input_ids=None, out: torch.Tensor | None = None,
              next_n: int = 1, logits_rows=None, staging=None) -> "BatchPlan":
        """Plan one step: :meth:`HostPlan.pack` (host), one upload (into ``out``, an int32 device
        buffer, when given; from a buffer of ``staging`` when given), :meth:`HostPlan.derive` (device)."""
        host = HostPlan.pack(query_lens, context_lens, block_tables, block_size, device, options=options,
                             input_ids=input_ids, next_n=next_n, logits_rows=logits_rows)
        return host.derive(host.upload(out, staging))


@dataclass
class HostPlan:
    """A step's routing and packed int32 facts on the host; ``derive`` makes the device plan.

    A CUDA graph captures ``derive`` and the layers; each replay packs a new HostPlan of the same
    ``bucket`` (so the same ``spec``), uploads it into the captured buffer and replays.
    """
    query_lens: np.ndarray  # [B'] rows per request (a decode request's next_n), padding requests included
    context_lens: np.ndarray  # [B'] the position of each one's first row: its cached tokens (S - next_n: decode)
    num_requests: int  # B: requests before the padding rows
    block_size: int
    index_topk: int | None
    max_seq_len: int
    device: torch.device
    bucket: Bucket | None  # the CUDA graph bucket the step is padded to (None: eager shapes)
    route: Route
    spec: dict  # name -> (offset, shape) in the packed buffer
    packer: _Packer
    next_n: int  # rows per decode request
    row_index: np.ndarray  # [T] int64, the plan row of each row given (input_ids' order)

    @classmethod
    def pack(cls, query_lens, context_lens, block_tables, block_size: int, device, *,
             options: PlanOptions = PlanOptions(), input_ids=None, input_src=None, bucket: Bucket | None = None,
             graphs: bool = False, next_n: int = 1, logits_rows=None) -> "HostPlan":
        """Check, pad, route and pack the step's facts; no device work.

        Args:
            query_lens: new tokens per request (``>= 1``); context_lens: tokens already cached.
            block_tables: ``[B, MB]`` int tensor/array, or one sequence of block ids per request.
            block_size: ``P``. options: the model's :class:`PlanOptions` (default: no indexer, all
                dense, absorbed prefill).
            input_ids: ``[T]`` token ids to upload with the plan (``plan.input_ids``), or None.
            input_src: with ``input_ids``, ``[T]`` ints: for a row whose id is still being sampled
                by the step before (overlapped scheduling), that step's row to read it from; -1:
                the id is in ``input_ids`` (None: all -1). Packed as ``src`` (:meth:`view`); the
                runner copies those ids on the device before the step runs.
            bucket: pad this decode-only step to a CUDA graph :class:`Bucket`.
            graphs: pad the step to its own bucket (:func:`~dsa.model.route.graph_bucket`) when it
                has one (``host.bucket``; None: the step runs eagerly).
            next_n: rows per decode request (module docstring): 1, plain decode (a request of one
                new token decodes); N + 1 in a verify step (a request of at most N + 1 decodes).
            logits_rows: ``[R]`` ints, rows of ``input_ids``' order whose logits the step returns
                (``plan.logits_rows``, mapped to the plan's rows); None: each request's last row. In a
                graph bucket they are padded with row 0 to ``bucket.rows * next_n`` entries.
        """
        if not isinstance(options, PlanOptions):
            raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
        next_n = check_int("next_n", next_n, minimum=1)
        query, context = _check_lengths(query_lens, context_lens)
        seq = context + query
        longest, t = int(seq.max(initial=0)), int(query.sum())
        bucket = _choose_bucket(query, longest, block_size, bucket, graphs, next_n)
        num_requests, num_rows = len(query), len(query) if bucket is None else bucket.rows
        width = None if bucket is None else cdiv(bucket.max_seq_len, block_size)
        tables = _block_array(block_tables, num_requests, width, num_rows)
        if bucket is None and (cdiv(seq, block_size) > tables.shape[1]).any():  # (a bucket's tables are wide enough)
            raise ValueError(f"block_tables: expected [B={num_requests}, >= ceil(S / {block_size})] blocks per "
                             f"request, got {list(tables.shape)} for seq_lens {seq.tolist()}")
        ids, src = _check_ids(input_ids, input_src, t)
        rows = _logits_rows(logits_rows, t)
        if bucket is not None:
            return cls._decode(query, seq, tables, ids, src, rows, t, block_size, device, options, bucket)
        return cls._general(query, context, seq, tables, ids, src, rows, block_size, device, options, None, next_n)

    @classmethod
    def _general(cls, query, context, seq, tables, ids, src, rows, block_size: int, device, options: PlanOptions,
                 bucket: Bucket | None, next_n: int) -> "HostPlan":
        """:meth:`pack` of checked inputs (``tables`` ``[B', MB]`` int32, ``rows`` None or ``[R]`` int64): the
        layout, the route and the parts by the general arrays. :meth:`pack` takes it for every step but a
        graph bucket's (:meth:`_decode`, whose plans the tests compare with this one's at a ``bucket``)."""
        num_requests, num_rows = len(query), len(query) if bucket is None else bucket.rows
        lay = _Layout.of(query, context, seq, next_n, num_rows)
        if ids is not None:
            ids, src = lay.scatter(ids, 0), lay.scatter(src, -1)
        rows = lay.first_row + lay.query - 1 if rows is None else lay.row_index[rows]
        if bucket is not None and len(rows) < bucket.rows * next_n:
            rows = np.concatenate((rows, np.zeros(bucket.rows * next_n - len(rows), np.int64)))
        max_seq_len = int(seq.max(initial=0)) if bucket is None else bucket.max_seq_len
        routed = route(lay.query, lay.start, lay.first_row, num_requests, max_seq_len, options, next_n, lay.new)
        spec, packer = _pack(lay, tables, ids, src, rows, routed)
        return cls(lay.query, lay.start, num_requests, block_size, options.index_topk, max_seq_len,
                   torch.device(device), bucket, routed, spec, packer, next_n, lay.row_index)

    @classmethod
    def _decode(cls, query, seq, tables, ids, src, rows, num_tokens: int, block_size: int, device,
                options: PlanOptions, bucket: Bucket) -> "HostPlan":
        """:meth:`_general` of a decode-only step padded to a graph ``bucket`` (``query`` ``[B]`` of at most
        ``bucket.next_n`` each, ``seq`` ``[B]`` int64, ``tables`` ``[rows, width]`` int32): the same plan, its
        parts written into one int32 buffer by a few whole-array ops (:func:`_decode_parts`)."""
        n, num_rows = bucket.next_n, bucket.rows
        num_logits = num_rows * n if rows is None else max(len(rows), num_rows * n)
        facts = _decode_facts(bucket, len(query), num_tokens, num_logits, ids is not None, tables.shape[1],
                              options.index_topk)
        row_index = facts.row_index if facts.row_index is not None else _decode_row_index(query, num_tokens, n)
        start = np.zeros(num_rows, np.int64)
        start[:len(query)] = seq - n  # a decode request's rows end at S - 1; a padding request's sit at 0 ..
        packer = _decode_parts(facts, start[:len(query)], seq, tables, ids, src, rows, row_index)
        return cls(facts.query_lens, start, len(query), block_size, options.index_topk, bucket.max_seq_len,
                   torch.device(device), bucket, facts.route, facts.spec, packer, n, row_index)

    def upload(self, out: torch.Tensor | None = None, staging=None) -> torch.Tensor:
        """The packed facts on the device: one non-blocking copy (into ``out`` when given), from a
        buffer of ``staging`` (a :class:`~dsa.engine.staging.PinnedBuffers` of int32) when given, else
        from one pinned for this copy."""
        return self.packer.upload(self.device, out, staging)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """One packed entry (``ids``, ``src``, ``positions``, ...) of the uploaded buffer."""
        return _view(buf, self.spec[name])

    def derive(self, buf: torch.Tensor) -> BatchPlan:
        """The device plan from the uploaded buffer: views, slots, per-path rows (no host sync)."""
        spec, routed, device = self.spec, self.route, self.device
        block_table, seq_lens = _view(buf, spec["table"]), _view(buf, spec["seq_lens"])
        row_to_req, positions = _view(buf, spec["row_to_req"]), _view(buf, spec["positions"])
        slot_mapping = positions_to_slots(positions[:, None], block_table, row_to_req, seq_lens, self.block_size)[:, 0]
        decode = self._decode_rows(buf, block_table, seq_lens) if len(routed.decode_reqs) else None
        every = self._every_position(decode) if routed.every_position else None
        zeros = torch.zeros(positions.shape[0], dtype=torch.int32, device=device) \
            if routed.sparse or routed.mha else None
        valid = _view(buf, spec["valid"]) if "valid" in spec else None
        dense_seq = _view(buf, spec["dense_seq"]) if "dense_seq" in spec else None  # mha, then absorbed
        sparse = tuple(_rows(seg, block_table, seq_lens[seg.req:seg.req + 1], valid) for seg in routed.sparse)
        mha = tuple(self._mha_rows(seg, block_table, dense_seq[j:j + 1], valid, zeros)
                    for j, seg in enumerate(routed.mha))
        absorbed = tuple(_rows(seg, block_table, dense_seq[j:j + 1], valid)
                         for j, seg in enumerate(routed.absorbed, len(routed.mha)))
        b = self.num_requests
        return BatchPlan(
            query_lens=tuple(self.query_lens[:b].tolist()), context_lens=tuple(self.context_lens[:b].tolist()),
            block_size=self.block_size, max_seq_len=self.max_seq_len, route=routed,
            input_ids=_view(buf, spec["ids"]) if "ids" in spec else None, positions=positions,
            slot_mapping=slot_mapping, row_to_req=row_to_req, block_table=block_table, seq_lens=seq_lens,
            logits_rows=_view(buf, spec["logits_rows"]),
            indexer=IndexerBatch(positions, slot_mapping, None if every is not None else decode, every, sparse, zeros),
            decode=decode, sparse_prefill_rows=_view(buf, spec["sparse_rows"]).long() if routed.sparse else None,
            mha=mha, absorbed=absorbed)

    def _decode_rows(self, buf, block_table, seq_lens) -> DecodeRows:
        """The decode rows' views: their row ids and (``next_n > 1``) visible lengths were packed on the host
        (:func:`_decode_row_facts`)."""
        r, n, spec = len(self.route.decode_reqs), self.next_n, self.spec
        if self.route.contiguous:
            rows, table, lens = slice(0, r * n), block_table[:r], seq_lens[:r]
        else:
            reqs = _view(buf, spec["decode_reqs"]).long()
            rows, table, lens = _view(buf, spec["decode_rows"]).long(), block_table[reqs], seq_lens[reqs]
        row_ids = _view(buf, spec["decode_row_ids"])
        visible = lens if n == 1 else _view(buf, spec["decode_lengths"])
        return DecodeRows(rows, table, lens, row_ids, self.max_seq_len, n, visible)

    def _every_position(self, d: DecodeRows) -> torch.Tensor:
        """``[R * N, K]`` slots of positions ``0 .. K-1`` of each decode row (-1 from its visible
        length on): top-k's answer when every context fits in ``index_topk``."""
        k = torch.arange(self.index_topk, dtype=torch.int32, device=self.device)
        positions = torch.where(k[None, :] < d.lengths[:, None], k[None, :], -1)
        return positions_to_slots(positions, d.block_table, d.row_ids, d.seq_lens, self.block_size)

    def _mha_rows(self, seg: Segment, block_table, seq_len, valid, zeros) -> PrefillRows:
        """A dense MHA segment with the slots of its keys, built here once for every layer."""
        keys = torch.arange(seg.num_keys, dtype=torch.int32, device=self.device)
        slots = positions_to_slots(keys[None], block_table[seg.req:seg.req + 1], zeros[:1], seq_len, self.block_size)[0]
        return _rows(seg, block_table, seq_len, valid, slots)


def _rows(seg: Segment, block_table, seq_len, valid, slots=None) -> PrefillRows:
    """``seg`` with its views: its request's table row, ``seq_len`` ``[1]``, its rows' valid lengths."""
    return PrefillRows(seg.req, seg.row0, seg.row1, seg.pos0, block_table[seg.req:seg.req + 1], seq_len,
                       valid[seg.rows], slots)


def _logits_rows(rows, num_tokens: int) -> np.ndarray | None:
    """``logits_rows`` checked: None, or a 1-D int array of rows in ``[0, T)``."""
    if rows is None:
        return None
    a = np.asarray(rows.detach().cpu() if isinstance(rows, torch.Tensor) else rows)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"logits_rows: expected a 1-D sequence of row indices, got shape {list(a.shape)} {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size and int(a.astype(np.uint64).max()) >= num_tokens:  # (one pass: a negative row wraps past 2^63)
        raise ValueError(f"logits_rows: rows must be in [0, {num_tokens}) (the step's rows), got {a.min()}..{a.max()}")
    return a


def _decode_row_facts(seq: np.ndarray, next_n: int) -> tuple:
    """``(row_ids, lengths)`` of ``R`` decode requests of lengths ``seq`` ``[R]``, ``next_n`` rows each: row
    ``b * next_n + j`` reads ``block_table[b]`` and sees ``max(0, S_b - next_n + j + 1)`` positions (``lengths``
    None at ``next_n = 1``: ``seq_lens``)."""
    if next_n == 1:
        return np.arange(len(seq)), None
    lengths = (seq[:, None] + np.arange(1 - next_n, 1)).reshape(-1)
    return np.repeat(np.arange(len(seq)), next_n), np.maximum(lengths, 0, out=lengths)


def _pack(lay: _Layout, tables, ids, src, logits_rows, routed: Route) -> tuple[dict, _Packer]:
    """The packed buffer's layout (name -> (offset, shape)) and its host parts: the facts every
    step needs, then only those its routing reads."""
    query, first_row = lay.query, lay.first_row
    req = np.repeat(np.arange(len(query)), query)
    positions = np.arange(lay.num_tokens) - first_row[req] + lay.start[req]
    row_to_req = lay.scatter(req[lay.row_index], -1)  # the padding rows' -1: they write nowhere
    pack = _Packer()
    spec = dict(positions=pack.add(positions), row_to_req=pack.add(row_to_req), seq_lens=pack.add(lay.seq),
                table=pack.add(tables, tables.shape), logits_rows=pack.add(logits_rows))
    if ids is not None:
        spec["ids"], spec["src"] = pack.add(ids), pack.add(src)
    if len(routed.decode_reqs):
        row_ids, lengths = _decode_row_facts(lay.seq[routed.decode_reqs], routed.next_n)
        spec["decode_row_ids"] = pack.add(row_ids)
        if lengths is not None:
            spec["decode_lengths"] = pack.add(lengths)
    if len(routed.decode_reqs) and not routed.contiguous:
        n = routed.next_n
        spec["decode_rows"] = pack.add((first_row[routed.decode_reqs][:, None] + np.arange(n)).reshape(-1))
        spec["decode_reqs"] = pack.add(routed.decode_reqs)
    dense = routed.mha + routed.absorbed
    if dense or routed.sparse:
        spec["valid"] = pack.add(positions + 1)
    if dense:  # each dense segment's own context: its last row's position + 1
        spec["dense_seq"] = pack.add([seg.num_keys for seg in dense])
    if routed.sparse:
        spec["sparse_rows"] = pack.add(routed.sparse_rows)
    return spec, pack


class _DecodeFacts(NamedTuple):
    """What every step of one graph bucket and row count shares (:func:`_decode_facts`; read-only)."""
    query_lens: np.ndarray  # [B'] int64, next_n each
    spec: dict
    route: Route
    row_index: np.ndarray | None  # [T] int64 when every request is full (plan rows 0 .. T - 1), else None
    template: np.ndarray  # the packed buffer but for the step's own values: each padding entry's fill
    offsets: np.ndarray  # [next_n] int64, 1 - next_n .. 0: row j of a request of S tokens sees S + offsets[j]


@functools.lru_cache(maxsize=4096)
def _decode_facts(bucket: Bucket, num_requests: int, num_tokens: int, num_logits: int, with_ids: bool, width: int,
                  index_topk: int | None) -> _DecodeFacts:
    """The facts of a graph bucket's step of ``num_requests`` requests, ``num_tokens`` rows given and ``num_logits``
    logits rows (padded), its block tables ``width`` wide: the same for every such step, so shared by their plans
    (read-only: the arrays unwritable, the route's row counts a read-only mapping). The template holds the padding
    requests' positions ``0 ..`` and ``row_to_req`` -1 (every request's own when all are full), zeros for the
    padding requests' lengths and tables, each request's last row as its logits row (ids 0, src -1), every decode
    row's row id (the padding requests' rows' visible lengths 0)."""
    num_rows, n = bucket.rows, bucket.next_n
    rn = num_rows * n
    table, logits = 2 * rn + num_rows, 2 * rn + num_rows + num_rows * width  # offsets
    spec = dict(positions=(0, rn), row_to_req=(rn, rn), seq_lens=(2 * rn, num_rows), table=(table, (num_rows, width)),
                logits_rows=(logits, num_logits))
    end = logits + num_logits
    if with_ids:
        spec["ids"], spec["src"] = (end, rn), (end + rn, rn)
        end += 2 * rn
    spec["decode_row_ids"] = (end, rn)
    if n > 1:
        spec["decode_lengths"] = (end + rn, rn)
    template = np.zeros(end + rn * (1 + (n > 1)), np.int32)
    template[:rn] = np.tile(np.arange(n), num_rows)
    template[rn:2 * rn] = -1
    template[logits:logits + num_rows] = np.arange(n - 1, rn, n)
    if with_ids:
        template[end - rn:end] = -1  # src
    template[end:end + rn] = np.arange(rn) // n  # decode_row_ids; a padding request's lengths: 0
    row_index = np.arange(num_tokens) if num_tokens == num_requests * n else None
    if row_index is not None:
        template[rn:rn + num_tokens] = row_index // n
    routed = decode_route(num_rows, num_tokens, bucket.max_seq_len, index_topk, n)
    routed = dataclasses.replace(routed, rows=MappingProxyType(routed.rows))
    facts = _DecodeFacts(np.full(num_rows, n, np.int64), spec, routed, row_index, template, np.arange(1 - n, 1))
    for a in (facts.query_lens, routed.decode_reqs, row_index, template, facts.offsets):
        if a is not None:
            a.flags.writeable = False
    return facts


def _decode_row_index(query: np.ndarray, num_tokens: int, next_n: int) -> np.ndarray:
    """``[T]`` int64, the plan row of each row given of a graph bucket's step (``query`` ``[B]``, each at most
    ``next_n``, ``T`` in all, some short): request ``i``'s rows end at plan row ``(i + 1) * next_n - 1``."""
    ends = np.cumsum(query)
    return np.repeat(np.arange(next_n, (len(query) + 1) * next_n, next_n) - ends, query) + np.arange(num_tokens)


def _decode_parts(facts: _DecodeFacts, start, seq, tables, ids, src, rows, row_index) -> _Packer:
    """:func:`_pack` of a graph bucket's step: ``facts.template`` with the step's own values (``start``/``seq``
    ``[B]`` int64 each request's first position and length, ``tables`` ``[B', width]`` int32, ``ids``/``src``
    None or ``[T]``, ``rows`` None or ``[R]`` int64 given rows, ``row_index`` ``[T]`` int64): the same bytes."""
    spec, b, n = facts.spec, len(seq), facts.route.next_n
    buf = facts.template.copy()
    buf[:b * n].reshape(b, n)[:] = start[:, None] + np.arange(n)  # positions
    if facts.row_index is None:  # (a full step's row_to_req is the template's)
        buf[n * len(facts.query_lens) + row_index] = row_index // n
    lens, table, logits = spec["seq_lens"][0], spec["table"][0], spec["logits_rows"][0]
    buf[lens:lens + b] = seq
    if n > 1:  # the requests' rows' visible lengths (_decode_row_facts)
        at, lengths = spec["decode_lengths"][0], seq[:, None] + facts.offsets
        np.maximum(lengths, 0, out=lengths)
        buf[at:at + b * n] = lengths.reshape(-1)
    buf[table:logits] = tables.reshape(-1)
    if rows is not None:
        buf[logits:logits + len(rows)] = row_index[rows]
        buf[logits + len(rows):logits + spec["logits_rows"][1]] = 0
    if ids is not None:
        for name, values in (("ids", ids), ("src", src)):
            at = spec[name][0]
            if facts.row_index is not None:
                buf[at:at + len(values)] = values
            else:
                buf[at + row_index] = values
    packer = _Packer()
    packer.parts, packer.size = [buf], buf.size
    return packer


class PackedStep:
    """Several packed plans and int32 arrays in one buffer, uploaded in one copy (a speculating step's
    verify plan, its drafter's chained proposal plans and the small index arrays its device passes read).
    ``layout`` is the same for every step of one CUDA graph bucket (each part's spec and shape)."""

    def __init__(self, plans: dict, arrays: dict):
        self.plans, self.offsets, self.packer = plans, {}, _Packer()
        for name, host in plans.items():
            self.offsets[name] = (self.packer.size, host.packer.size)
            self.packer.parts += host.packer.parts
            self.packer.size += host.packer.size
        for name, array in arrays.items():
            a = np.asarray(array)
            self.offsets[name] = self.packer.add(a, a.shape)
        self.layout = ({name: host.spec for name, host in plans.items()},
                       {name: shape for name, (_, shape) in self.offsets.items() if name not in plans})

    @property
    def size(self) -> int:
        return self.packer.size

    def upload(self, device, out: torch.Tensor | None = None, staging=None) -> torch.Tensor:
        """Every part on the device: one non-blocking copy (into ``out`` when given)."""
        return self.packer.upload(torch.device(device), out, staging)

    def part(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """A plan's own buffer (for its ``derive`` and ``view``) or an array, int32, of the uploaded ``buf``."""
        offset, shape = self.offsets[name]
        if name in self.plans:
            return buf[offset:offset + shape]
        return _view(buf, (offset, shape))

    def derive(self, buf: torch.Tensor, name: str) -> BatchPlan:
        return self.plans[name].derive(self.part(buf, name))
