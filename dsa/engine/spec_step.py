"""A speculating step on the device (issue #39): two device passes over one uploaded buffer, replayed as two
CUDA graphs of the step's verify bucket when every request decodes.

Host (:func:`pack`): the verify plan (each request's last token, then ``out.num_drafts`` draft rows whose ids
the device reads from the drafts; :meth:`~dsa.model.plan.HostPlan.pack` at ``next_n = N + 1``), the drafter's
parts (``drafter.prepare``: the MTP drafter's chained proposal plans and state rows, the scripted drafter's
drafts) and the step's index arrays, in one :class:`~dsa.model.plan.PackedStep`: one upload. The step has
``S'`` slots: its ``S`` sampled requests (in a graph bucket, ``rows`` slots: padding slots after them, whose
indices point at scratch rows).

Device, the same ops eagerly or captured:

1. :func:`draft_verify`: the drafts ``[S', N]`` (-1 past each slot's), read into the verify rows' ids; the
   target's forward; the greedy acceptance (the longest prefix of drafts equal to the argmax), its tokens and
   accepted counts packed for the step's one read;
2. a step with a sampled request runs the rejection sampler eagerly between the two passes, and its tokens
   and accepted counts replace the greedy ones (:meth:`SpecResult.accept`); the read's copy is queued here;
3. :func:`observe`: the drafter's pass over the verify rows (the MTP module: its caches, each request's next
   first draft and hidden state). The host reads the tokens while it runs: it finishes the step and packs
   the next one meanwhile (stream order keeps the next step's upload and passes after it).

A graph is captured on the bucket's padding step (every row writes nowhere, every index a scratch row), at
the warm-up or on first use, so a capture changes no request's state.
"""
import functools
from dataclasses import dataclass

import numpy as np
import torch

from dsa.engine.drafter import Slots, pad_to
from dsa.engine.rejection import rejection_sample
from dsa.kernels import pick_ids
from dsa.model.plan import Bucket, HostPlan, PackedStep


@dataclass
class SpecStep:
    """A speculating step on the host, packed for its one upload (module docstring)."""
    packed: PackedStep  # "verify", the drafter's plans; "next_*" (_next_ids), "anchor"; the drafter's arrays
    sampled: np.ndarray  # [S] the step index of each sampled request
    rows: np.ndarray  # [B] the requests' rows of the input batch
    slots: int  # S': S, or the graph bucket's rows
    num_drafts: np.ndarray  # [S] drafts each sampled request carries

    @property
    def host(self) -> HostPlan:
        return self.packed.plans["verify"]

    @property
    def bucket(self) -> Bucket | None:
        return self.host.bucket


@dataclass
class SpecGraph:
    """The two captured passes of one verify bucket, the buffer they read and the outputs they rewrite."""
    draft_verify: object  # torch.cuda.CUDAGraph (or the tests' emulation)
    observe: object
    buf: torch.Tensor  # [packed.size] int32
    layout: tuple  # PackedStep.layout of the bucket
    spec: dict  # the verify plan's layout
    outputs: tuple  # draft_verify's: drafts, logits, hidden, tokens, accepted, packed


@dataclass
class SpecResult:
    """A launched step's device side (views of a graph's outputs when replayed: read before the next step)."""
    step: SpecStep
    buf: torch.Tensor
    drafts: torch.Tensor  # [S', N] int64, -1 past a slot's drafts
    logits: torch.Tensor  # [S', N + 1, vocab] fp32: each slot's rows, its last token's first
    hidden: torch.Tensor  # [T', hidden]: every verify row's hidden state after the final norm
    tokens: torch.Tensor  # [S', N + 1] int64: the accepted drafts, then one more token, then -1
    accepted: torch.Tensor  # [S'] int64
    packed: torch.Tensor  # [S', N + 2] float64: each slot's tokens, then its accepted count (the step's read)
    graph: SpecGraph | None  # the graphs replayed (None: eager)

    def accept(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """The rejection sampler's tokens and counts of the first ``S`` slots, in place of the greedy ones."""
        s = tokens.shape[0]
        self.tokens[:s].copy_(tokens)
        self.accepted[:s].copy_(accepted)
        self.packed[:s].copy_(_packed_tokens(tokens, accepted))


def pack(runner, out) -> SpecStep:
    """The host side of a step (its deltas already applied): request ``i`` computes ``out.num_rows[i]`` rows
    from ``out.computed[i]``, its last ``out.num_drafts[i]`` the drafts of its sampled row."""
    batch, n = runner.batch, runner.next_n - 1
    rows = batch.rows(out.rids)
    q, c, k = (np.asarray(a, np.int64) for a in (out.num_rows, out.computed, out.num_drafts))
    sampled = np.fromiter((s.row for s in out.sampled), np.int64, len(out.sampled))
    at = slice(None) if len(sampled) == len(q) else sampled  # (every request sampled: in row order, 0 .. B - 1)
    ks = k[at]
    drafts = int(ks.sum())
    ends, nxt = np.cumsum(q), c + q  # each request's rows end before; its next position
    full = drafts == len(ks) * n  # every sampled request carries N drafts
    each = n + 1 if len(q) and ends[-1] == len(q) * (n + 1) and full and len(ks) == len(q) else None  # (each one
    # of >= N + 1 rows: its last token, then its drafts)
    ids, src = batch.input_ids(rows, q, c, each)
    base = (ends - 1 - k)[at]  # the row of each sampled request's last token
    src = _draft_src(ids, np.full(len(ids), -1) if src is None else src, base, ks, drafts, n)
    batch.expect(rows[at], (nxt - k)[at], sampled)  # each one's sampled place
    after = np.maximum(batch.token_ids[rows, np.minimum(nxt, batch.token_ids.shape[1] - 1)], 0)  # each one's next id
    offsets = np.arange(n + 1) if full else np.minimum(np.arange(n + 1), ks[:, None])  # [S, N + 1]
    width = max(batch.num_blocks[rows].max(initial=1), 1)
    host = HostPlan.pack(q, c, batch.block_table[rows, :width], runner.model.config.block_size, runner.device,
                         options=runner.plan_options, input_ids=ids, input_src=src, graphs=runner.use_graphs,
                         next_n=n + 1, logits_rows=(base[:, None] + offsets).reshape(-1))
    slots = Slots(rows[at], c[at], ks, len(sampled) if host.bucket is None else host.bucket.rows,
                  host.bucket)
    return _packed(runner, host, slots, sampled, rows, host.row_index[base], host.row_index[ends - 1], after)


def _draft_src(ids: np.ndarray, src: np.ndarray, base: np.ndarray, drafts: np.ndarray, total: int,
               n: int) -> np.ndarray:
    """``src [T]`` with each draft row's: draft row ``j`` of sampled request ``s`` (rows ``base[s] + 1 ..``,
    ``drafts[s]`` of them, ``[S]`` each, ``total`` in all) reads draft ``s * n + j``; its id in ``ids`` 0 (what
    the row reads where its draft is -1: :func:`draft_verify`)."""
    if total == len(drafts) * n:  # every request carries N drafts: a grid
        rows, at = (base[:, None] + np.arange(1, n + 1)).reshape(-1), np.arange(total)
    elif total:
        j = np.arange(total) - np.repeat(np.cumsum(drafts) - drafts, drafts)
        rows, at = np.repeat(base + 1, drafts) + j, np.repeat(np.arange(len(drafts)) * n, drafts) + j
    else:
        return src
    src[rows], ids[rows] = at, 0
    return src


def padding_step(runner, bucket: Bucket) -> SpecStep:
    """A verify bucket's step of padding rows only: what its graphs are captured on."""
    host = runner._padding_plan(bucket.rows, bucket.max_seq_len, bucket.next_n)
    none = np.zeros(0, np.int64)
    return _packed(runner, host, Slots(none, none, none, bucket.rows, bucket), none, none, none, none, none)


def _packed(runner, host: HostPlan, slots: Slots, sampled, rows, base, last, after) -> SpecStep:
    """The step's parts in one buffer: the plans, the verify rows' next ids (:func:`_next_ids`) and the
    drafter's arrays (``base`` ``[S]``: the plan row of each sampled slot's last token; ``last`` ``[B]``: of each
    request's last row, ``after`` ``[B]`` the id after it)."""
    t = host.spec["positions"][1]  # T': a position per plan row
    plans, arrays = runner.drafter.prepare(runner, slots)
    packed = PackedStep({"verify": host, **plans},
                        {**_next_ids(t, runner.next_n, base, slots.num_drafts, last, after, host.bucket is not None),
                         "anchor": pad_to(np.minimum(base, t - 1), slots.size, t - 1), **arrays})
    return SpecStep(packed, sampled, rows, slots.size, slots.num_drafts)


def _next_ids(t: int, rows: int, base, drafts, last, after, cached: bool) -> dict:
    """Where each of the ``T'`` verify rows finds the id after it (:func:`~dsa.kernels.pick_ids` in the
    drafter's observation): ``next_token`` ``[T']``, for row ``j`` of sampled slot ``s`` (rows ``base[s] ..
    base[s] + drafts[s]``), its emitted token ``s * rows + j`` (``rows``: N + 1), where it has one; else
    ``next_row`` ``[T']``, the next row's id (the last row's: row 0's); else, at each request's last row
    (``last``), ``next_id`` ``[T']`` the id after it (``after``). -1: none. The first two are the same for
    every step of one layout: ``cached`` (a graph bucket's step, whose layouts repeat) keeps them
    (:func:`_next_rows`); an eager step's, whose layouts mostly do not, are made anew (no cache to grow)."""
    keys = (np.asarray(a, np.int64).tobytes() for a in (base, drafts, last))
    next_token, next_row = (_next_rows if cached else _next_rows.__wrapped__)(t, rows, *keys)
    next_id = np.zeros(t, np.int32)
    next_id[last] = after
    return {"next_token": next_token, "next_row": next_row, "next_id": next_id}


@functools.lru_cache(maxsize=4096)
def _next_rows(t: int, rows: int, base: bytes, drafts: bytes, last: bytes) -> tuple:
    """``(next_token, next_row)`` ``[T']`` int32 of :func:`_next_ids` (``base``, ``drafts``, ``last``: int64
    bytes), read-only."""
    base, drafts, last = (np.frombuffer(a, np.int64) for a in (base, drafts, last))
    next_row = np.arange(1, t + 1, dtype=np.int32)
    next_row[-1:] = 0
    next_row[last] = -1
    next_token = np.full(t, -1, np.int32)
    j = np.arange(rows)
    emits = j <= drafts[:, None]  # [S, N + 1]
    next_token[(base[:, None] + j)[emits]] = (np.arange(len(base))[:, None] * rows + j)[emits]
    for a in (next_token, next_row):
        a.flags.writeable = False
    return next_token, next_row


def draft_verify(runner, step: SpecStep, buf: torch.Tensor) -> tuple:
    """The first pass: ``(drafts, logits, hidden, tokens, accepted, packed)`` (:class:`SpecResult`), greedy."""
    drafts = runner.drafter.draft(runner, step, buf)
    verify = step.packed.part(buf, "verify")
    if drafts.numel():  # (a step of no sampled request, always eager, has no draft to read)
        ids = step.host.view(verify, "ids")  # a draft row's id is 0 where its draft is -1 (pack)
        pick_ids(ids, drafts.reshape(-1), step.host.view(verify, "src"), out=ids)
    logits, hidden = runner._forward(step.packed.derive(buf, "verify"), True)
    logits = logits[:step.slots * runner.next_n].view(step.slots, runner.next_n, logits.shape[-1])
    tokens, accepted = rejection_sample(logits, drafts, all_greedy=True)
    return drafts, logits, hidden, tokens, accepted, _packed_tokens(tokens, accepted)


def _packed_tokens(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``[S, N + 2]`` float64: each slot's tokens, then its accepted count (the staging dtype of the read)."""
    return torch.cat((tokens, accepted[:, None]), dim=1).double()


def observe(runner, step: SpecStep, buf: torch.Tensor, hidden, tokens, accepted) -> tuple:
    """The second pass: the drafter's observation of the verify rows (no outputs: it writes the drafter's
    caches and state)."""
    ids = step.host.view(step.packed.part(buf, "verify"), "ids")
    runner.drafter.observe(runner, step, buf, step.packed.derive(buf, "verify"), ids, hidden, tokens, accepted)
    return ()


def capture(runner, bucket: Bucket) -> SpecGraph:
    """Capture a verify bucket's two passes on its padding step (into ``runner.graphs``)."""
    step = padding_step(runner, bucket)
    buf = torch.zeros(step.packed.size, dtype=torch.int32, device=runner.device)
    step.packed.upload(runner.device, buf)
    first, outputs = runner.record(lambda: draft_verify(runner, step, buf))
    first.replay()  # a captured graph has not run: its outputs (the indices the second pass reads) hold nothing yet
    second, _ = runner.record(lambda: observe(runner, step, buf, *outputs[2:5]))
    g = runner.graphs[bucket] = SpecGraph(first, second, buf, step.packed.layout, step.host.spec, outputs)
    return g


def run(runner, out) -> SpecResult:
    """Pack a step, upload it once and run its first pass (by its bucket's graph when it has one)."""
    step = pack(runner, out)
    device = runner.device
    if step.bucket is None:
        buf = step.packed.upload(device, staging=runner.staging)
        return SpecResult(step, buf, *draft_verify(runner, step, buf), None)
    g = runner.graphs.get(step.bucket) or capture(runner, step.bucket)
    if step.packed.layout != g.layout:
        raise AssertionError("a verify graph bucket's step layout changed")
    step.packed.upload(device, g.buf, runner.staging)
    g.draft_verify.replay()
    return SpecResult(step, g.buf, *g.outputs, g)


def finish(runner, result: SpecResult) -> None:
    """The second pass (by the bucket's graph when the first replayed one)."""
    if result.graph is not None:
        result.graph.observe.replay()
    else:
        observe(runner, result.step, result.buf, result.hidden, result.tokens, result.accepted)

