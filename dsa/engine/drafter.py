"""Drafters for speculative decoding: what proposes a verify step's draft tokens.

A drafter has three calls per step of a speculating engine (:mod:`dsa.engine.spec_step`), the first on the
host, the others device ops only (no host sync, the same eagerly and inside the step's CUDA graphs, which
are captured on padding steps):

- ``prepare(runner, slots) -> (plans, arrays)``: the :class:`Slots` of the step's sampled requests (the
  runner's input batch already holds the step's deltas); what its device passes read, packed into the
  step's one upload: ``{name: HostPlan}`` and ``{name: int array}`` (``S'`` entries per slot array);
- ``draft(runner, step, buf) -> drafts [S', N]`` int64 on the model's device, before the target runs: a
  row per slot, its ``num_drafts`` first entries drafts, ``-1`` after them (``step.packed.part(buf, name)``
  reads a prepared part);
- ``observe(runner, step, buf, plan, ids, hidden, tokens, accepted)``, after the acceptance: ``plan`` the
  verify rows' :class:`~dsa.model.plan.BatchPlan`, ``ids [T']`` their input ids (drafts read in), ``hidden
  [T', hidden]`` the target's hidden states, ``tokens [S', N + 1]`` / ``accepted [S']`` each slot's.

:class:`MTPDrafter` drafts with the model's MTP module (:mod:`dsa.model.mtp`), DeepSeek-V3's chaining as
vLLM and SGLang run it: ``observe`` runs the module over the verify step's rows (the main model's hidden
states, each row with the token after it; the rows after a request's accepted ones are overwritten
before any later row reads them), which writes its layer's caches at every computed position and drafts
the first token after the accepted ones; ``draft`` chains the others, one MTP decode row per slot and
draft, at positions whose rows the same step's ``observe`` rewrites. Drafts are the module's argmax (a
deterministic drafter: the rejection sampler's ``q`` is one-hot). :class:`ScriptedDrafter` is the test
drafter: proposals from a function of the request's tokens (e.g. the target's own greedy continuation),
with scripted mismatches.
"""
import functools
from dataclasses import dataclass

import numpy as np
import torch

from dsa.kernels import pick_ids
from dsa.model.plan import HostPlan
from dsa.model.route import Bucket

DRAFT_CAP = 2 ** 31 - 1  # a slot's cap where it drafts: above every token id (int32: the packed buffer's type)


@dataclass
class Slots:
    """The sampled requests of a speculating step as its drafter sees them: ``S`` of them in ``size`` slots
    (``S``, or the verify graph bucket's rows: padding slots after them)."""
    rows: np.ndarray  # [S] their input-batch rows
    computed: np.ndarray  # [S] the position of each one's first row (a decoding request's last token)
    num_drafts: np.ndarray  # [S] drafts each carries (0 .. N)
    size: int  # S'
    bucket: Bucket | None  # the verify step's graph bucket (None: eager)


def pad_to(values, size: int, fill: int) -> np.ndarray:
    """``values`` then ``fill`` up to ``size`` entries (int32: an index of the step's packed upload)."""
    if len(values) == size:
        return np.asarray(values, np.int32)
    out = np.full(size, fill, np.int32)
    out[:len(values)] = values
    return out


@functools.lru_cache(maxsize=4096)
def _draft_cap(size: int, n: int, drafts: bytes) -> np.ndarray:
    """``[size, n]`` int32, read-only: :data:`DRAFT_CAP` at each slot's drafts (``drafts``: int64 bytes of their
    counts, then padding slots of none), -1 past them; ``min(draft, cap)`` keeps a slot's drafts."""
    k = np.zeros(size, np.int64)
    k[:len(drafts) // 8] = np.frombuffer(drafts, np.int64)
    cap = np.where(np.arange(n)[None, :] < k[:, None], DRAFT_CAP, -1).astype(np.int32)
    cap.flags.writeable = False
    return cap


class MTPDrafter:
    """Drafts with ``model.mtp`` over the runner's caches (allocated with the MTP layer's) and its own
    per-row state: the first draft and the module's hidden state of each input-batch row, and one scratch
    row (``rows``) that the padding slots of a graph bucket read and write."""

    needs_hidden = True  # the runner returns the verify rows' hidden states
    uses_mtp_caches = True  # the engine allocates the MTP layer's caches

    def __init__(self, model, num_tokens: int, rows: int):
        if model.mtp is None:
            raise ValueError("speculative_tokens: the model has no MTP module (num_nextn_predict_layers = 0); "
                             "give a drafter or a checkpoint with one")
        self.model, self.n, self.scratch = model, num_tokens, rows
        self.first = torch.zeros(rows + 1, dtype=torch.int64, device=model.device)
        self.hidden = torch.zeros(rows + 1, model.config.hidden_size, dtype=model.dtype, device=model.device)

    def prepare(self, runner, slots: Slots) -> tuple:
        """The state row of each slot, and a plan per chained draft ``j = 2 ..``: one MTP decode row per slot
        at position ``c + j - 2`` (``c``: the slot's ``computed``), clamped into the slot's verify rows
        ``c .. c + k`` (a slot of fewer than ``j`` drafts: a row whose draft is dropped, at a position the
        step's ``observe`` rewrites). A graph bucket chains all ``N - 1`` (padded to its rows), an eager
        step as many as its longest request needs."""
        k, c = slots.num_drafts, slots.computed
        chains = self.n - 1 if slots.bucket is not None else max(int(k.max(initial=0)) - 1, 0)
        plans = {f"chain{j}": self._chain_plan(runner, slots, c + np.maximum(np.minimum(j - 2, k - 1), 0))
                 for j in range(2, 2 + chains)}
        return plans, {"state": pad_to(slots.rows, slots.size, self.scratch),
                       "cap": (_draft_cap if slots.bucket is not None else _draft_cap.__wrapped__)(  # (cached for
                           slots.size, self.n, np.asarray(k, np.int64).tobytes())}  # a graph bucket's layouts only)

    def _chain_plan(self, runner, slots: Slots, context: np.ndarray) -> HostPlan:
        """One MTP decode row per slot after ``context`` cached tokens (a graph bucket's rows and context)."""
        batch, p = runner.batch, self.model.config.block_size
        b = slots.bucket
        width = max(int(batch.num_blocks[slots.rows].max(initial=1)), 1) if b is None else b.max_seq_len // p
        return HostPlan.pack(np.ones(len(context), np.int64), context, batch.block_table[slots.rows, :width], p,
                             runner.device, options=runner.plan_options,
                             bucket=None if b is None else Bucket(b.rows, b.max_seq_len))

    def draft(self, runner, step, buf: torch.Tensor) -> torch.Tensor:
        """Each slot's first draft and hidden state from its state row (``index_select``: int32 indices as they
        are), the chained drafts, then ``-1`` past each slot's drafts (the packed ``cap``)."""
        part = step.packed.part
        state = part(buf, "state")
        tok, h = self.first.index_select(0, state), self.hidden.index_select(0, state)
        drafts = [tok]
        for j in range(2, self.n + 1):  # draft j at position c + j - 1, from the module's row at c + j - 2
            if f"chain{j}" in step.packed.plans:  # (else no slot drafts j: the cap drops it)
                logits, h = self.model.mtp_step(step.packed.derive(buf, f"chain{j}"), runner.caches, tok, h)
                tok = logits.argmax(dim=-1)
            drafts.append(tok)
        return torch.minimum(drafts[0][:, None] if self.n == 1 else torch.stack(drafts, dim=1), part(buf, "cap"))

    def observe(self, runner, step, buf, plan, ids, hidden, tokens, accepted) -> None:
        """The module over the step's rows (a decode request's padding rows write nowhere): every row with
        the token after it (:func:`~dsa.kernels.pick_ids` of the packed ``next_*`` arrays: a sampled slot's
        emitted token at each of its accepted rows and the row after them, else the next input id in its
        request, else at a request's last row the next prompt token of a chunk), the first draft and hidden
        state of each slot's request from its last accepted row (``anchor + accepted``: a padding slot's the
        plan's last row)."""
        part = step.packed.part
        nxt = pick_ids(part(buf, "next_id"), tokens.reshape(-1), part(buf, "next_token"), ids, part(buf, "next_row"))
        at = part(buf, "anchor") + accepted
        logits, y = self.model.mtp_step(plan, runner.caches, nxt, hidden, logits_rows=at)
        state = part(buf, "state").long()  # (one cast for both writes: indexing casts an int32 index itself)
        self.first[state] = logits.argmax(dim=-1)
        self.hidden[state] = y[at]


class ScriptedDrafter:
    """A test drafter: ``propose_fn(tokens, k) -> k`` ints (the request's tokens so far: prompt and
    generated), each replaced by ``(t + 1) % vocab_size`` where ``wrong(count, j)`` says so (``count``:
    the proposals made so far, one per request and step; ``j``: the draft's index), so tests choose
    every accepted length. Its drafts are host ints packed into the step's upload."""

    needs_hidden = False
    uses_mtp_caches = False

    def __init__(self, propose_fn, num_tokens: int, vocab_size: int, wrong=lambda step, j: False):
        self.propose_fn, self.n, self.vocab_size, self.wrong = propose_fn, num_tokens, vocab_size, wrong
        self.calls = 0
        self.proposed = 0  # drafts proposed so far (the tests read it, and ``accepted``)
        self._accepted = None  # [] int64 on the device once prepared: read by ``accepted``, never inside a step

    def prepare(self, runner, slots: Slots) -> tuple:
        if self._accepted is None:
            self._accepted = torch.zeros((), dtype=torch.int64, device=runner.model.device)
        drafts = np.full((slots.size, self.n), -1, np.int64)
        for s, (row, c, kk) in enumerate(zip(slots.rows.tolist(), slots.computed.tolist(),
                                             slots.num_drafts.tolist())):
            if not kk:
                continue
            proposal = list(self.propose_fn(runner.batch.token_ids[row, :c + 1].tolist(), kk))[:kk]
            for j, t in enumerate(proposal):
                drafts[s, j] = (t + 1) % self.vocab_size if self.wrong(self.calls, j) else t
            self.calls += 1
        self.proposed += int(slots.num_drafts.sum())
        return {}, {"drafts": drafts}

    def draft(self, runner, step, buf) -> torch.Tensor:
        return step.packed.part(buf, "drafts").long()

    def observe(self, runner, step, buf, plan, ids, hidden, tokens, accepted) -> None:
        self._accepted.add_(accepted.sum())  # a padding slot accepts none

    @property
    def accepted(self) -> int:
        """Drafts accepted so far (a host read: call it between steps)."""
        return 0 if self._accepted is None else int(self._accepted)
