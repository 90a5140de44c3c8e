"""ModelRunner: runs a scheduled step through the model, replaying a CUDA graph when it can.

It owns the caches and the running requests' rows (:class:`~dsa.engine.input_batch.InputBatch`:
token ids, block tables, sampling parameters), which each step's deltas update before its inputs
are gathered from them.

Prefill and mixed steps run eagerly. A decode-only step (every request one new token) is padded to
a batch-size bucket (1, 2, 4, ..., 128; padding rows see nothing and write nowhere) and a context
bucket (the paged-logits width and block-table width), and replays the graph captured for that
bucket by :meth:`ModelRunner.warmup` (or, without a warm-up, the first time it is used): the host
packs the step's ints, copies them into the graph's buffer in one transfer, reads the input ids
still being sampled by the step before on the device, and replays; the logits of the real rows
come back. Replay gives bitwise the logits of the eager path run at the same padded shapes.
Models with MoE layers run eagerly (their expert dispatch reads routing decisions on the host).

A speculating runner (``speculative_tokens = N``) runs its steps through :mod:`dsa.engine.spec_step`:
the drafter's proposals, the decode path with ``next_n = N + 1`` rows per request (:mod:`dsa.model.plan`:
a request's last token and its drafts, padded in front to N + 1 rows; the paged indexer logits score every
key once for all of them, top-k per row, sparse MLA over the rows), the greedy acceptance and the drafter's
observation, from one upload. A verify step whose every request decodes replays the two graphs of its
``(batch bucket, context bucket, next_n)`` (:class:`~dsa.model.route.Bucket`, ``graphs``' key); a step with
prefill chunks runs the same ops eagerly, its decode requests on the same decode path.
"""
import time
from dataclasses import dataclass

import numpy as np
import torch

from dsa.engine import spec_step
from dsa.engine.input_batch import InputBatch
from dsa.engine.sampling import SamplingBatch
from dsa.engine.staging import PinnedBuffers
from dsa.kernels.common import cdiv, check_int
from dsa.kernels.topk import warm_topk_slots
from dsa.model.layers import MoE
from dsa.model.plan import BatchPlan, Bucket, HostPlan
from dsa.model.route import BATCH_BUCKETS, context_buckets, gemm_rows


@dataclass
class StepResult:
    """One step's logits (one row per request, fp32), its sampling rows and what the plan says
    about it. Replayed logits are a view of the graph's output: read them before the next step."""
    logits: torch.Tensor  # [B, vocab] fp32
    sampling: SamplingBatch  # the rows' sampling parameters (InputBatch.sampling)
    rows: dict  # rows served per path (dsa.model.plan.PATHS)
    workspace_bytes: int  # the MHA workspace the step needed
    graph: bool  # replayed from a CUDA graph


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buf: torch.Tensor  # the int32 plan buffer the graph reads
    spec: dict  # the plan layout it was captured with
    logits: torch.Tensor  # [rows bucket, vocab] fp32, written by each replay


class ModelRunner:
    """Owns an engine's caches; plans each step and runs it (eagerly, or by graph replay)."""

    def __init__(self, model, num_blocks: int, cuda_graphs: bool | None = None, max_num_seqs: int = 256,
                 max_model_len: int | None = None, mtp_caches: bool = False, speculative_tokens: int = 0,
                 drafter=None):
        self.model = model
        self.device = model.device  # (a module's device property walks its parameters: read once)
        self.drafter = drafter  # a speculating runner's (dsa.engine.drafter): its passes run inside the step
        self.next_n = check_int("speculative_tokens", speculative_tokens, minimum=0) + 1  # rows per decode request
        self.caches = model.allocate_caches(num_blocks, mtp=True) if mtp_caches else model.allocate_caches(num_blocks)
        possible = model.device.type == "cuda" and not any(isinstance(m, MoE) for m in model.modules())
        if cuda_graphs and not possible:
            raise ValueError("cuda_graphs: needs a model on a CUDA device without MoE layers (MoE dispatch reads "
                             f"routing on the host); this model is on {model.device}")
        self.use_graphs = possible if cuda_graphs is None else bool(cuda_graphs)
        self.graphs: dict = {}  # Bucket (rows bucket, context bucket, next_n) -> _Graph (spec_step.SpecGraph: N > 0)
        # the row counts the eager steps' GEMMs ran at (route.gemm_rows): cuBLASLt plans each once per weight
        # shape and keeps it in its heuristics cache (host memory); at most max_batch_tokens / GEMM_ROW_ALIGN
        self.gemm_row_counts: set = set()
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.plan_options = model.plan_options()  # the same every step
        c = model.config
        longest = c.max_position_embeddings if max_model_len is None else max_model_len  # a request's tokens
        self.batch = InputBatch(max_num_seqs, min(longest, num_blocks * c.block_size), cdiv(longest, c.block_size),
                                c.vocab_size)
        # each step's packed plan (a speculating step's: with its drafter's parts and index arrays), on its way up
        self.staging = PinnedBuffers(model.device, torch.int32)
        # a speculating step's rejection sampler parameters (a step with a sampled request: 6 copies), on their way up
        self.uploads = {np.dtype(np.int64): PinnedBuffers(model.device, torch.int64, max_slots=32),
                        np.dtype(np.float32): PinnedBuffers(model.device, torch.float32, max_slots=8)}

    def run(self, out, previous=None) -> StepResult:
        """Run a :class:`~dsa.engine.scheduler.SchedulerOutput`: its deltas into the batch first,
        then request ``i`` computes the positions ``computed[i] .. + num_rows[i] - 1``. A decode
        row whose input token is still :data:`~dsa.engine.scheduler.PENDING` (sampled by the step
        in flight) reads it on the device from ``previous``, that step's sampled tokens [B']."""
        batch = self.batch
        batch.apply(out)
        rows = batch.rows(out.rids)
        q, c = out.num_rows, out.computed
        decode_only = all(n == 1 for n in q)
        ends = np.add(c, q)  # each request's next token: the one sampled, where the row samples
        ids, src = batch.input_ids(rows, np.asarray(q), np.asarray(c), 1 if decode_only else None)
        if src is not None and previous is None:
            raise RuntimeError("run: an input token is still being sampled, but no previous step's tokens were given")
        sampled = np.fromiter((s.row for s in out.sampled), np.int64, len(out.sampled))
        batch.expect(rows[sampled], ends[sampled], sampled)
        sampling = batch.sampling.take(rows, ends)
        width = max(batch.num_blocks[rows].max(initial=1), 1)
        host = HostPlan.pack(q, c, batch.block_table[rows, :width], self.model.config.block_size, self.device,
                             options=self.plan_options, input_ids=ids, input_src=src, graphs=self.use_graphs)
        logits, graph = self._launch(host, None if src is None else previous)
        return StepResult(logits[:len(q)], sampling, host.route.rows, host.route.workspace_bytes, graph)

    def _launch(self, host: HostPlan, pending: torch.Tensor | None) -> tuple:
        """Run a packed decode or prefill step: replay its bucket's graph (captured on first use) or run it
        eagerly; ids still pending (``src >= 0``) are read from ``pending`` on the device first. Returns
        ``(logits [R, vocab], replayed)``."""
        if host.bucket is not None:
            g = self.graphs.get(host.bucket) or self._capture(host)
            if host.spec != g.spec:
                raise AssertionError("a graph bucket's plan layout changed")
            host.upload(g.buf, self.staging)
            if pending is not None:
                _read_pending(host, g.buf, pending)
            g.graph.replay()
            return g.logits, True
        buf = host.upload(staging=self.staging)
        if pending is not None:
            _read_pending(host, buf, pending)
        self.gemm_row_counts.add(gemm_rows(int(host.query_lens.sum()), host.route.decode_only))
        logits, _ = self._forward(host.derive(buf), False)
        return logits, False

    def _forward(self, plan: BatchPlan, verify: bool) -> tuple:
        """``(logits, hidden or None)`` of one step: a decode step's every row (its requests' last
        rows), a verify step's ``plan.logits_rows`` and every row's hidden state."""
        if verify:
            return self.model.step(plan, self.caches, logits_rows=plan.logits_rows, return_hidden=True)
        return self.model.step(plan, self.caches, logits_rows=plan.logits_rows), None

    def upload(self, array) -> torch.Tensor:
        """A small host array on the device without a host sync (a pageable ``.to(device)`` waits for the
        stream): int64 (other ints and bools widened) or float32, by a non-blocking copy from a pinned
        buffer of :attr:`uploads`; on the CPU a copy of the array."""
        a = np.asarray(array)
        dtype = np.dtype(np.float32 if a.dtype.kind == "f" else np.int64)
        return self.uploads[dtype].copy_to(np.array(a, dtype))

    def _capture(self, host: HostPlan) -> _Graph:
        """Capture the decode step of one bucket. The warm-up and the capture run this step's own
        rows (writing the same cache rows the replay writes again)."""
        buf = torch.zeros(host.packer.size, dtype=torch.int32, device=self.model.device)
        host.upload(buf)
        if "ids" in host.spec:  # an id still pending (PENDING = -1) is read in before each replay, not here
            host.view(buf, "ids").clamp_(min=0)
        graph, (logits,) = self.record(lambda: (self.model.step(host.derive(buf), self.caches),))
        self.graphs[host.bucket] = g = _Graph(graph, buf, host.spec, logits)
        return g

    def record(self, step) -> tuple:
        """``(graph, outputs)``: ``step()`` run once on a side stream (it compiles kernels and settles
        allocations), then captured into a CUDA graph of the runner's pool; ``outputs`` are the
        captured run's, which each ``graph.replay()`` rewrites. The only CUDA-specific part of a
        graph step: the rest (buffer, plan, outputs) is the same on every device."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        return graph, outputs

    def context_buckets(self, max_context: int) -> list:
        """Every decode context bucket up to ``max_context`` tokens."""
        return context_buckets(max_context, self.model.config.block_size)

    def warmup(self, max_batch_tokens: int, max_context: int, max_decode_rows: int, progress: bool = True) -> dict:
        """Launch once every kind of step this runner can be asked for, so that no kernel compiles
        and no CUDA graph is captured on a later step: prefill chunks of each size class up to
        ``max_batch_tokens`` rows (dense and sparse rows, no prefix and a long one), the top-k's
        finish tiles (:func:`~dsa.kernels.topk.warm_topk_slots`), and decode steps
        at every batch and context bucket up to ``max_decode_rows`` x ``max_context`` (with graphs:
        captured here, padding rows only); a speculating runner's at ``next_n = N + 1`` too (its
        verify steps: two graphs a bucket, :func:`~dsa.engine.spec_step.capture`, with the drafter's
        passes inside; the decode steps of one row stay eager, for the eager steps' kernels). Every row
        writes into scratch blocks or nowhere: call it before any request holds blocks. Returns what it
        did (steps, graphs, seconds, bytes)."""
        from tqdm import tqdm

        c, p = self.model.config, self.model.config.block_size
        num_blocks = self.caches.num_blocks
        capacity = num_blocks * p
        max_context = min(max_context, capacity)
        ladder = lambda top: sorted({min(top, 1 << i) for i in range(top.bit_length() + 1)} | {top})  # noqa: E731
        prefill = [(t, 0) for t in ladder(max_batch_tokens)]  # chunks from a fresh prompt: dense, then sparse rows
        prefill += [(t, ctx) for ctx in ladder(max(1, max_context - max_batch_tokens))[1:]  # behind a long prefix
                    for t in (1, max_batch_tokens) if ctx + t <= max_context]
        if c.index_topk is not None:  # a few dense rows behind a prefix: the absorbed kernel's split variant
            prefill += [(t, c.index_topk - t) for t in (2, 16) if t <= max_batch_tokens and c.index_topk > t]
        rows = [b for b in BATCH_BUCKETS if b <= max_decode_rows] or [1]
        widths = sorted({1, self.next_n})
        # the largest graphs first (as vLLM captures): each smaller one reuses the memory a larger one freed in
        # the graphs' shared pool; in ascending order each context bucket's transients (the paged logits) need a
        # new, larger block, and the pool held their sum (26 GiB at 1M tokens and 8 batch buckets on the H200)
        decode = [(b, ctx, n) for n in widths for ctx in reversed(self.context_buckets(max_context))
                  for b in reversed(rows)]
        sync = torch.cuda.synchronize if self.model.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        bar = tqdm(total=len(prefill) + len(decode), desc="warm-up", unit="step", disable=not progress)
        for t, ctx in prefill:
            table = (np.arange(cdiv(ctx + t, p)) % num_blocks)[None].astype(np.int32)
            ids = np.zeros(t, np.int32)
            plan = BatchPlan.build([t], [ctx], table, p, self.model.device, options=self.plan_options, input_ids=ids)
            self.model.step(plan, self.caches, logits_rows=plan.logits_rows)
            bar.update()
        if c.index_topk is not None:  # the top-k's finish tiles: a constexpr chosen by width and rows
            warm_topk_slots(c.index_topk, max_context, max(max_batch_tokens, rows[-1] * self.next_n), p,
                            self.model.device)
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # the graphs' memory is what the pool holds after them
        graphs, before = 0, _reserved(self.model.device)
        for b, ctx, n in decode:
            if self.use_graphs and n == self.next_n:
                if n > 1 and Bucket(b, ctx, n) not in self.graphs:  # a verify bucket: a speculating step's two passes
                    spec_step.capture(self, Bucket(b, ctx, n))
                    graphs += 2
                elif Bucket(b, ctx, n) not in self.graphs:
                    self._capture(self._padding_plan(b, ctx, n))
                    graphs += 1
            else:  # every row at the bucket's last positions, in scratch block 0
                table = np.zeros((b, ctx // p), np.int32)
                plan = BatchPlan.build([n] * b, [ctx - n] * b, table, p, self.model.device, options=self.plan_options,
                                       input_ids=np.zeros(b * n, np.int32), next_n=n)
                self._forward(plan, n > 1)
            bar.update()
        bar.close()
        sync()
        return {"prefill_steps": len(prefill), "decode_buckets": len(decode), "graphs_captured": graphs,
                "seconds": round(time.perf_counter() - t0, 2), "graph_pool_bytes": _reserved(self.model.device) - before}

    def _padding_plan(self, rows: int, ctx: int, next_n: int = 1) -> HostPlan:
        """A decode-only plan of padding rows only (nothing read or written) for one graph bucket."""
        p = self.model.config.block_size
        return HostPlan.pack([], [], np.zeros((0, ctx // p), np.int32), p, self.model.device, options=self.plan_options,
                             input_ids=np.zeros(0, np.int32), bucket=Bucket(rows, ctx, next_n), next_n=next_n)


def decode_graph_estimate(config, max_context: int, max_decode_rows: int, next_n: int = 1) -> dict:
    """What the warm-up's decode graphs up to ``max_context`` tokens and ``max_decode_rows`` rows
    cost, from the shapes alone (no device): one graph per (batch bucket, context bucket) at
    ``next_n`` rows per request (N + 1: a speculating runner's verify graphs). Each holds for good
    its logits ``[rows * next_n, vocab]`` fp32 (in the graph pool; a verify graph its hidden states
    ``[rows * next_n, hidden]`` too, counted at 2 bytes: bf16) and its packed plan (block tables
    ``[rows, width / P]`` int32, outside it); while one runs it also needs the paged indexer logits
    ``[rows * next_n, width]`` fp32 of one layer at a time, which the graphs' shared pool reuses (the
    largest bucket's counts once)."""
    contexts = context_buckets(max_context, config.block_size)
    rows = [b for b in BATCH_BUCKETS if b <= max_decode_rows] or [1]
    blocks = sum(cdiv(ctx, config.block_size) for ctx in contexts)
    held = len(contexts) * sum(rows) * next_n  # output rows the graphs hold
    return {"context_buckets": len(contexts), "largest_context_bucket": contexts[-1],
            "graphs": len(contexts) * len(rows), "logits_bytes": held * config.vocab_size * 4,
            "hidden_bytes": held * config.hidden_size * 2 if next_n > 1 else 0,
            "plan_bytes": sum(rows) * (blocks + len(contexts) * 8 * next_n) * 4,  # tables + ~8 ints a row
            "paged_logits_bytes": rows[-1] * next_n * contexts[-1] * 4 if config.index_topk is not None else 0}


def _read_pending(host: HostPlan, buf: torch.Tensor, previous: torch.Tensor) -> None:
    """Copy the ids of the rows whose ``src >= 0`` from the previous step's sampled tokens (device
    ops only: the host never waits for them)."""
    ids, src = host.view(buf, "ids"), host.view(buf, "src").long()
    ids.copy_(torch.where(src >= 0, previous[src.clamp_min(0)].to(ids.dtype), ids))


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
