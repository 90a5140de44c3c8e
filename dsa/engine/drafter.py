"""Drafters for speculative decoding: what proposes a verify step's draft tokens.

A drafter has two calls per step of a speculating engine, and ``warmup(runner) -> graphs captured``,
which ``Engine.warmup`` calls after the runner's:

- ``propose(runner, out) -> drafts [S, N]`` int64 on the model's device, before the target runs: a row
  for each sampled request of the :class:`~dsa.engine.scheduler.SchedulerOutput` (in ``out.sampled``
  order), its ``out.num_drafts`` first entries drafts, ``-1`` after them (the runner's input batch
  already holds the step's deltas);
- ``observe(runner, out, result, tokens, accepted)``, after the rejection sampler: ``result`` the
  :class:`~dsa.engine.runner.VerifyResult`, ``tokens [S, N + 1]`` / ``accepted [S]`` on the device.

:class:`MTPDrafter` drafts with the model's MTP module (:mod:`dsa.model.mtp`), DeepSeek-V3's chaining as
vLLM and SGLang run it: ``observe`` runs the module over the verify step's rows (the main model's hidden
states, each row with the token after it; the rows after a request's accepted ones are overwritten
before any later row reads them), which writes its layer's caches at every computed position and drafts
the first token after the accepted ones; ``propose`` chains the others, one MTP decode row per request
and draft, at positions whose rows the next verify step rewrites. Drafts are the module's argmax (a
deterministic drafter: the rejection sampler's ``q`` is one-hot). :class:`ScriptedDrafter` is the test
drafter: proposals from a function of the request's tokens (e.g. the target's own greedy continuation),
with scripted mismatches.
"""
from dataclasses import dataclass

import numpy as np
import torch

from dsa.model.plan import HostPlan


def _sampled_rows(out) -> tuple:
    """``(step index of each sampled request, its drafts)`` as int64 arrays."""
    req = np.fromiter((s.row for s in out.sampled), np.int64, len(out.sampled))
    return req, np.asarray(out.num_drafts, np.int64)[req] if len(req) else np.zeros(0, np.int64)


@dataclass
class _MTPGraph:
    """A captured MTP pass: its plan buffer and input buffers (read by each replay) and its outputs
    (rewritten by each replay)."""
    graph: object  # torch.cuda.CUDAGraph (or the tests' emulation)
    buf: torch.Tensor  # the int32 plan buffer: a verify graph's (observe) or its own (propose)
    spec: dict  # the plan layout it was captured with
    ids: torch.Tensor  # [rows] int64: the token after each row
    hidden: torch.Tensor  # [rows, hidden]: each row's hidden state (observe: the verify graph's output)
    anchor: torch.Tensor | None  # [bucket rows] int64: the rows whose logits come back (observe)
    logits: torch.Tensor  # [bucket rows, vocab] fp32
    out: torch.Tensor  # [rows, hidden]: the module's output, the next draft's hidden state


class MTPDrafter:
    """Drafts with ``model.mtp`` over the runner's caches (allocated with the MTP layer's) and its own
    per-row state: the first draft and the module's hidden state of each input-batch row. When the
    runner replays CUDA graphs, so do its passes: the observation pass of a replayed verify step one
    graph per verify bucket (reading that verify graph's plan buffer and hidden states), each chained
    proposal one graph per decode bucket (:meth:`warmup` captures both)."""

    needs_hidden = True  # the runner returns the verify rows' hidden states
    uses_mtp_caches = True  # the engine allocates the MTP layer's caches

    def __init__(self, model, num_tokens: int, rows: int):
        if model.mtp is None:
            raise ValueError("speculative_tokens: the model has no MTP module (num_nextn_predict_layers = 0); "
                             "give a drafter or a checkpoint with one")
        self.model, self.n = model, num_tokens
        self.first = torch.zeros(rows, dtype=torch.int64, device=model.device)
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=model.dtype, device=model.device)
        self.graphs: dict = {}  # ("observe" | "propose", Bucket) -> _MTPGraph

    def warmup(self, runner) -> int:
        """Capture the observation pass of every verify graph the runner holds and a chained proposal at
        each of their batch and context buckets (padding rows only: nothing read or written). Returns
        the graphs captured."""
        if not runner.use_graphs:
            return 0
        before = len(self.graphs)
        for bucket, g in list(runner.graphs.items()):
            if bucket.next_n != self.n + 1:
                continue
            host = runner._padding_plan(bucket.rows, bucket.max_seq_len, bucket.next_n)
            if ("observe", bucket) not in self.graphs:
                self._capture_observe(runner, host, g.buf, g.hidden)
            plain = runner._padding_plan(bucket.rows, bucket.max_seq_len, 1)
            if self.n > 1 and ("propose", plain.bucket) not in self.graphs:
                self._capture_propose(runner, plain)
        return len(self.graphs) - before

    def propose(self, runner, out) -> torch.Tensor:
        req, k = _sampled_rows(out)
        model, batch, device = self.model, runner.batch, self.model.device
        drafts = torch.full((len(req), self.n), -1, dtype=torch.int64, device=device)
        spec = np.flatnonzero(k > 0)
        if not len(spec):
            return drafts
        rows = batch.rows([out.rids[i] for i in req[spec]])
        rows_t = runner.upload(rows)
        idx = runner.upload(spec)
        tok, h = self.first[rows_t], self.hidden[rows_t]
        drafts[idx, 0] = tok
        c = np.asarray(out.computed, np.int64)[req[spec]]  # the position of each one's last token
        for j in range(2, int(k.max()) + 1):  # draft j at position c + j - 1, from the module's row at c + j - 2
            live = np.flatnonzero(k[spec] >= j)
            width = max(int(batch.num_blocks[rows[live]].max()), 1)
            sel = runner.upload(live)
            logits, y = self._chain(runner, c[live] + j - 2, batch.block_table[rows[live], :width], tok[sel], h[sel])
            tok, h = tok.clone(), h.clone()
            tok[sel], h[sel] = logits.argmax(dim=-1), y
            drafts[idx[sel], j - 1] = tok[sel]
        return drafts

    def observe(self, runner, out, result, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """The module over the step's rows (the verify plan's: a decode request's padding rows write
        nowhere): every row with the token after it (the next input id in its request; a request's
        last row, the next prompt token of a chunk; the sampled request's emitted token at its last
        accepted row), the first draft of each sampled request from that row."""
        req, _ = _sampled_rows(out)
        batch = runner.batch
        q, c = np.asarray(out.num_rows, np.int64), np.asarray(out.computed, np.int64)
        nxt = torch.roll(result.ids.long(), -1)
        after = batch.token_ids[result.rows, np.minimum(c + q, batch.token_ids.shape[1] - 1)].clip(0)
        nxt[runner.upload(result.last)] = runner.upload(after)
        if len(req):
            anchor = runner.upload(result.base) + accepted
            nxt[anchor] = tokens.gather(1, accepted[:, None])[:, 0]
        if result.graph:
            logits, y = self._observe_replay(runner, result, nxt, anchor if len(req) else None)
        else:
            logits, y = self.model.mtp_step(result.plan, runner.caches, nxt, result.hidden,
                                            logits_rows=anchor if len(req) else None)
        if len(req):
            rows = runner.upload(result.rows[req])
            self.first[rows] = logits.argmax(dim=-1)
            self.hidden[rows] = y[anchor]

    def _chain(self, runner, context: np.ndarray, tables: np.ndarray, tok: torch.Tensor, h: torch.Tensor) -> tuple:
        """``(logits [L, vocab], out [L, hidden])``: one MTP decode row per live request, the row after
        ``context`` cached tokens, by its decode bucket's graph when the runner replays graphs."""
        model, n = self.model, len(context)
        p = model.config.block_size
        host = HostPlan.pack([1] * n, context, tables, p, model.device, options=runner.plan_options,
                             input_ids=np.zeros(n, np.int32), graphs=runner.use_graphs)  # ids: the bucket's layout
        if host.bucket is None:
            return model.mtp_step(host.derive(host.upload(staging=runner.staging)), runner.caches, tok, h)
        g = self.graphs.get(("propose", host.bucket)) or self._capture_propose(runner, host)
        if host.spec != g.spec:
            raise AssertionError("a proposal graph bucket's plan layout changed")
        host.upload(g.buf, runner.staging)
        g.ids[:n].copy_(tok)
        g.hidden[:n].copy_(h)
        g.graph.replay()
        return g.logits[:n], g.out[:n]

    def _capture_propose(self, runner, host: HostPlan) -> _MTPGraph:
        model, rows = self.model, host.bucket.rows
        buf = torch.zeros(host.packer.size, dtype=torch.int32, device=model.device)
        host.upload(buf)
        ids = torch.zeros(rows, dtype=torch.int64, device=model.device)
        hidden = torch.zeros(rows, model.config.hidden_size, dtype=model.dtype, device=model.device)
        graph, (logits, out) = runner.record(lambda: model.mtp_step(host.derive(buf), runner.caches, ids, hidden))
        g = self.graphs[("propose", host.bucket)] = _MTPGraph(graph, buf, host.spec, ids, hidden, None, logits, out)
        return g

    def _observe_replay(self, runner, result, nxt: torch.Tensor, anchor: torch.Tensor | None) -> tuple:
        """The observation pass of a replayed verify step by its bucket's graph: ``(logits [S, vocab],
        out [T', hidden])``."""
        bucket = result.host.bucket
        g = self.graphs.get(("observe", bucket)) or self._capture_observe(runner, result.host, result.buf,
                                                                          result.hidden)
        if g.buf is not result.buf or g.hidden is not result.hidden:
            raise AssertionError("an observation graph reads another verify graph's buffers")
        s = 0 if anchor is None else len(anchor)
        g.ids.copy_(nxt)
        if s:
            g.anchor[:s].copy_(anchor)
        g.anchor[s:].zero_()
        g.graph.replay()
        return g.logits[:s], g.out

    def _capture_observe(self, runner, host: HostPlan, buf: torch.Tensor, hidden: torch.Tensor) -> _MTPGraph:
        model = self.model
        ids = torch.zeros(hidden.shape[0], dtype=torch.int64, device=model.device)
        anchor = torch.zeros(host.bucket.rows, dtype=torch.int64, device=model.device)
        graph, (logits, out) = runner.record(lambda: model.mtp_step(host.derive(buf), runner.caches, ids, hidden,
                                                                    logits_rows=anchor))
        g = self.graphs[("observe", host.bucket)] = _MTPGraph(graph, buf, host.spec, ids, hidden, anchor, logits, out)
        return g


class ScriptedDrafter:
    """A test drafter: ``propose_fn(tokens, k) -> k`` ints (the request's tokens so far: prompt and
    generated), each replaced by ``(t + 1) % vocab_size`` where ``wrong(count, j)`` says so (``count``:
    the proposals made so far, one per request and step; ``j``: the draft's index), so tests choose
    every accepted length."""

    needs_hidden = False
    uses_mtp_caches = False

    def __init__(self, propose_fn, num_tokens: int, vocab_size: int, wrong=lambda step, j: False):
        self.propose_fn, self.n, self.vocab_size, self.wrong = propose_fn, num_tokens, vocab_size, wrong
        self.calls = 0
        self.proposed = 0  # drafts proposed so far (the tests read it, and ``accepted``)
        self._accepted = 0  # on the device once a step ran: read by ``accepted``, never inside a step

    def propose(self, runner, out) -> torch.Tensor:
        req, k = _sampled_rows(out)
        drafts = np.full((len(req), self.n), -1, np.int64)
        for s, (i, kk) in enumerate(zip(req.tolist(), k.tolist())):
            if not kk:
                continue
            row = runner.batch.row_of[out.rids[i]]
            tokens = runner.batch.token_ids[row, :out.computed[i] + 1].tolist()
            proposal = list(self.propose_fn(tokens, kk))[:kk]
            for j, t in enumerate(proposal):
                drafts[s, j] = (t + 1) % self.vocab_size if self.wrong(self.calls, j) else t
            self.calls += 1
        self.proposed += int(k.sum())
        return runner.upload(drafts)

    def warmup(self, runner) -> int:
        return 0  # host proposals: nothing to capture

    def observe(self, runner, out, result, tokens, accepted) -> None:
        self._accepted = self._accepted + accepted.sum()

    @property
    def accepted(self) -> int:
        """Drafts accepted so far (a host read: call it between steps)."""
        return int(self._accepted)
