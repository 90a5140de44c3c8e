"""Routing: which implementation serves each row of a step, decided once per step on the host.

Rows are the step's new tokens, requests concatenated in order. A row's function is fixed by its
own valid range ``[0, pos]``: one that exceeds ``index_topk`` attends to its top-k (sparse); any
other row, and every row of a model without an indexer, attends to all of it (dense). Routing
chooses only among implementations of that function:

- decode rows (a request with one new token; in a verify step of speculative decoding, a request of
  at most ``next_n`` new tokens, padded to ``next_n`` rows: :mod:`dsa.model.plan`) of a model with
  an indexer all go through top-k + sparse MLA; when every context of the step fits in
  ``index_topk``, the top-k of each is every position, which the plan hands over without scoring
  (the same function as dense attention), so a row's path never depends on the rest of its batch;
  without an indexer they take the dense absorbed decode;
- dense prefill rows take up-projected MHA (SDPA) or the absorbed kernel (``Dispatch``).

:func:`route` returns a :class:`Route`; the plan (:mod:`dsa.model.plan`), the layers, the indexer
and the runner read its flags and segments instead of deciding again. A decode-only step can be
padded to a CUDA graph :class:`Bucket` (:func:`graph_bucket`), keyed by its rows per request too.
"""
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dsa.indexer.batch import Segment
from dsa.kernels.common import cdiv
from dsa.model.dispatch import Dispatch

# rows served per path (engine statistics), named by the kernels that run them: with an indexer
# every decode row runs top-k + the sparse kernel (a short row's top-k is every position); without
# one, the dense absorbed kernel. Prefill rows whose range fits in index_topk run dense.
PATHS = ("sparse_decode", "dense_decode", "sparse_prefill", "dense_prefill_mha", "dense_prefill_absorbed")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# an eager step's rows (prefill, mixed) go through the GEMMs padded to a multiple of this: cuBLASLt keeps
# host memory (~7 kB) for each (M, N, K) it plans, in an LRU of 8,192 entries, and a server meets every
# token count up to its budget; padded, the counts are at most max_batch_tokens / GEMM_ROW_ALIGN
GEMM_ROW_ALIGN = 64


def gemm_rows(num_tokens: int, decode_only: bool) -> int:
    """The rows a step's GEMMs run over: ``num_tokens`` padded to :data:`GEMM_ROW_ALIGN` unless the step
    only decodes (its rows are a CUDA graph bucket's, or at most ``max_num_seqs`` x ``next_n``)."""
    return num_tokens if decode_only else cdiv(num_tokens, GEMM_ROW_ALIGN) * GEMM_ROW_ALIGN
CONTEXT_STEP = 4096  # context buckets: powers of two up to this, then its multiples up to 128K, then
BUCKETS_PER_OCTAVE = 16  # this many per doubling (context_bucket)


def context_bucket(seq_len: int, block_size: int) -> int:
    """The paged-logits width a graph is captured for: a power of two (>= 256) up to 4096, then
    multiples of 4096 up to 128K, then BUCKETS_PER_OCTAVE per doubling (multiples of 8K up to 256K,
    16K up to 512K, 32K up to 1M, ...): 84 buckets up to 1M, a row padded by less than 1/16 of its
    length past 64K; always a multiple of the block size."""
    b = 256 if seq_len <= 256 else 1 << (seq_len - 1).bit_length()
    if b > CONTEXT_STEP:
        step = max(CONTEXT_STEP, b // (2 * BUCKETS_PER_OCTAVE))
        b = cdiv(seq_len, step) * step
    return cdiv(b, block_size) * block_size


def context_buckets(max_context: int, block_size: int) -> list:
    """Every context bucket up to the first that holds ``max_context`` tokens, in order."""
    out, s = [], 1
    while True:
        b = context_bucket(s, block_size)
        out.append(b)
        if b >= max_context:
            return out
        s = b + 1


def batch_bucket(rows: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if b >= rows), None)


class Bucket(NamedTuple):
    """A CUDA graph's shapes: a decode-only step padded to ``rows`` requests (padding rows see
    nothing and write nowhere) of ``next_n`` rows each (1: plain decode; N + 1: a verify step of
    speculative decoding), its paged logits ``max_seq_len`` wide and its block tables
    ``ceil(max_seq_len / P)`` wide. It is the runner's graph key."""
    rows: int
    max_seq_len: int
    next_n: int = 1


def graph_bucket(query_lens: np.ndarray, longest: int, block_size: int, next_n: int = 1) -> Bucket | None:
    """The bucket a step replays in: a decode-only step (every request at most ``next_n`` new
    tokens) of at most ``BATCH_BUCKETS[-1]`` requests (``longest``: its longest request) has one;
    any other step runs eagerly (None)."""
    rows = batch_bucket(len(query_lens))
    if not len(query_lens) or rows is None or query_lens.max() > next_n:
        return None
    return Bucket(rows, context_bucket(longest, block_size), next_n)


@dataclass(frozen=True)
class PlanOptions:
    """The model's routing facts, the same every step (:meth:`dsa.DSAModel.plan_options`)."""
    index_topk: int | None = None  # None: no indexer, every row dense
    dispatch: Dispatch | None = None  # speed choices between equivalent prefill implementations (None: absorbed)
    mha_kv_bytes_per_token: int = 0  # bytes of up-projected K/V per context token (the MHA workspace)

    def __post_init__(self):
        k = self.index_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"index_topk: expected a positive int or None, got {k!r}")
        kv = self.mha_kv_bytes_per_token
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 0:
            raise ValueError(f"mha_kv_bytes_per_token: expected an int >= 0, got {kv!r}")
        if self.dispatch is not None and not isinstance(self.dispatch, Dispatch):
            raise TypeError(f"dispatch: expected a Dispatch or None, got {type(self.dispatch).__name__}")


@dataclass(frozen=True)
class Route:
    """How one step's rows are served: every decision a layer, the indexer or the runner reads."""
    decode_reqs: np.ndarray  # [R] int64 decode requests (next_n rows each), in order, padding rows included
    next_n: int  # rows per decode request (1: plain decode; N + 1: a verify step)
    contiguous: bool  # the decode rows are rows 0 .. R * next_n - 1 (no gather)
    decode_only: bool  # every row decodes (R >= 1): attention needs no scatter
    sparse_decode: bool  # decode rows take top-k + sparse MLA (a model with an indexer), else dense decode
    every_position: bool  # decode rows' top-k is every position (max_seq_len <= index_topk): no scoring
    sparse: tuple  # Segment of each request's sparse prefill rows, in row order
    mha: tuple  # Segment of each request's dense prefill rows through up-projected MHA, in row order
    absorbed: tuple  # Segment of each request's dense prefill rows through the absorbed kernel, in row order
    sparse_rows: np.ndarray  # [rows] int64, the rows of ``sparse`` in order
    rows: dict  # rows served per PATHS entry (padding rows not counted)
    workspace_bytes: int  # the largest MHA workspace of the step


_NO_ROWS = np.zeros(0, np.int64)


def route(query_lens: np.ndarray, context_lens: np.ndarray, first_row: np.ndarray, num_requests: int,
          max_seq_len: int, options: PlanOptions, next_n: int = 1, new_rows: np.ndarray | None = None) -> Route:
    """Route a step: ``[B']`` int64 rows, position of the first row (its cached tokens, but for a
    decode request padded in front) and first row per request, the first ``num_requests`` real
    (the rest padding requests: ``next_n`` rows, nothing visible); a request of at most ``next_n``
    rows decodes (the plan pads each to exactly ``next_n``); ``max_seq_len``: the paged-logits width
    (an upper bound of every request's length); ``new_rows``: ``[B']`` the rows that are the
    requests' own new tokens (default ``query_lens``), which the statistics count."""
    k = options.index_topk
    is_decode = query_lens <= next_n  # padding rows too: they come last, after every real request
    decode_reqs = np.flatnonzero(is_decode)
    num_decode = len(decode_reqs)
    new = query_lens if new_rows is None else new_rows
    rows = dict.fromkeys(PATHS, 0)
    real = decode_reqs[decode_reqs < num_requests]
    rows["sparse_decode" if k is not None else "dense_decode"] = int(new[real].sum())
    sparse, mha, absorbed, workspace = (), (), (), 0
    if num_decode < len(query_lens):
        sparse, mha, absorbed, workspace = _prefill_segments(query_lens, context_lens, first_row,
                                                             np.flatnonzero(~is_decode), options, rows)
    sparse_rows = np.concatenate([np.arange(s.row0, s.row1) for s in sparse]) if sparse else _NO_ROWS
    contiguous = not num_decode or int(decode_reqs[-1]) == num_decode - 1
    return Route(decode_reqs=decode_reqs, next_n=next_n, contiguous=contiguous,
                 decode_only=0 < num_decode == len(query_lens), sparse_decode=k is not None,
                 every_position=num_decode > 0 and k is not None and max_seq_len <= k, sparse=sparse, mha=mha,
                 absorbed=absorbed, sparse_rows=sparse_rows, rows=rows, workspace_bytes=workspace)


def decode_route(num_rows: int, new_rows: int, max_seq_len: int, index_topk: int | None, next_n: int = 1) -> Route:
    """:func:`route` of a step padded to a graph bucket of ``num_rows`` requests (every one decodes, the
    padding ones last) whose real requests have ``new_rows`` new rows, for a model of ``index_topk``
    (:class:`PlanOptions`): the same Route, without its passes over the arrays."""
    k = index_topk
    rows = dict.fromkeys(PATHS, 0)
    rows["sparse_decode" if k is not None else "dense_decode"] = new_rows
    return Route(decode_reqs=np.arange(num_rows, dtype=np.int64), next_n=next_n, contiguous=True,
                 decode_only=num_rows > 0, sparse_decode=k is not None,
                 every_position=num_rows > 0 and k is not None and max_seq_len <= k, sparse=(), mha=(), absorbed=(),
                 sparse_rows=_NO_ROWS, rows=rows, workspace_bytes=0)


def _prefill_segments(query_lens, context_lens, first_row, prefill_reqs, options: PlanOptions, rows: dict):
    """``(sparse, mha, absorbed, workspace_bytes)``: per prefill request its dense rows (those whose
    range ``[0, pos]`` fits in ``index_topk``) and then its sparse rows; counts them into ``rows``."""
    limit = options.index_topk if options.index_topk is not None else np.iinfo(np.int64).max
    dispatch, kv_bytes = options.dispatch, options.mha_kv_bytes_per_token
    sparse, mha, absorbed, workspace = [], [], [], 0
    for i in prefill_reqs.tolist():
        new, cached, row0 = int(query_lens[i]), int(context_lens[i]), int(first_row[i])
        dense = max(0, min(new, limit - cached))
        if dense:
            keys = cached + dense
            uses_mha = dispatch is not None and dispatch.prefill_uses_mha(dense, keys, keys * kv_bytes)
            (mha if uses_mha else absorbed).append(Segment(i, row0, row0 + dense, cached))
            rows["dense_prefill_mha" if uses_mha else "dense_prefill_absorbed"] += dense
            workspace = max(workspace, keys * kv_bytes if uses_mha else 0)
        if dense < new:
            sparse.append(Segment(i, row0 + dense, row0 + new, cached + dense))
            rows["sparse_prefill"] += new - dense
    return tuple(sparse), tuple(mha), tuple(absorbed), workspace
