"""Scheduler: the waiting and running requests, their blocks, and the rows each step computes.

Each step (:meth:`Scheduler.schedule`) first gives every running request whose tokens are all
computed but its last one a decode row, growing its blocks by one when a block fills; when the
pool runs out, the most recently admitted running request is preempted (its blocks freed, it goes
back to the front of the queue and recomputes its prompt and generated tokens later; the tokens it
produced stay). Then the rest of ``max_batch_tokens`` goes to prefill chunks: running requests
first, oldest first, then waiting requests, admitted in order as far as blocks and
``max_num_seqs`` allow (a request gets blocks for the rows it computes, not for its worst case). A waiting request whose next
uncached prompt block is being computed by a running request waits for it rather than compute it
twice (in-flight prefix sharing). A request leaves by :meth:`update` (its last token) or
:meth:`remove` (an abort), which release its blocks at once.

The scheduler is the one writer of every :class:`Request` field once the engine has built it: the
block manager returns the blocks and names it hands out, and a step's sampled tokens come back
through :meth:`update`. The :class:`SchedulerOutput` of a step says which rows it computes and
everything the model runner's batch must change first (requests that left, new requests with
their tokens, blocks and sampling, blocks granted, tokens it has not seen), so the runner never
reads a :class:`Request`.
"""
from collections import deque
from dataclasses import dataclass, field

from dsa.engine.blocks import BlockManager, CacheFullError
from dsa.engine.sampling import GREEDY, SamplingParams
from dsa.kernels.common import cdiv

PENDING = -1  # a token id not known yet: sampled by a step still on the GPU (overlapped scheduling)


@dataclass(eq=False)
class Request:
    rid: int
    tokens: list  # prompt, then generated tokens (the last one PENDING while its step runs)
    prompt_len: int
    max_new_tokens: int
    blocks: list = field(default_factory=list)  # cache blocks, in position order
    block_names: list = field(default_factory=list)  # prefix-cache names of its full computed blocks, in order
    chain: list | None = None  # names of the full blocks of its tokens (BlockManager.chain), hashed once
    computed: int = 0  # tokens whose latent rows and indexer keys are in the caches (or will be, once the
    # steps launched have run)
    num_preemptions: int = 0
    # what the engine needs to sample and report (the scheduler does not read these)
    sampling: SamplingParams = GREEDY
    seed: int = 0  # the noise key of its sampled tokens
    text: object = None  # TextOutput, when the engine has a tokenizer
    on_output: object = None  # callable(Delta), called by whichever thread steps; must not raise

    @property
    def uncomputed(self) -> int:
        """Tokens still to compute: 1 for a decode row, more while (re)filling the caches."""
        return len(self.tokens) - self.computed

    @property
    def prefilling(self) -> bool:
        return self.uncomputed > 1

    @property
    def done(self) -> bool:
        """It has all the tokens it may generate (the last maybe still pending): its length limit,
        decided here alone."""
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


@dataclass
class NewRequest:
    """A request admitted (or resumed after a preemption) by this step: what its row in the
    runner's batch starts from."""
    rid: int
    tokens: list  # its tokens, all known (prompt, then generated): a copy
    blocks: list  # its blocks, this step's included: a copy
    sampling: SamplingParams
    seed: int


@dataclass
class SampledRow:
    """A row of the step whose token is sampled: it becomes ``request.tokens[index]`` (PENDING
    until :meth:`Scheduler.update`); ``last``: the request's length limit ends with it."""
    row: int  # the row's index in the step (its logits row)
    request: Request
    index: int
    last: bool
    drafts: int = 0  # draft tokens verified after it (speculative decoding): it may bring up to drafts + 1 tokens


@dataclass
class SchedulerOutput:
    """One step: the rows it computes, in row order (decode rows first), the rows that sample, and
    what changed since the last step that ran (the runner applies these first, in this order:
    ``finished``, ``new``, ``grants``, ``tokens``)."""
    rids: list = field(default_factory=list)  # requests computing rows
    num_rows: list = field(default_factory=list)  # rows each computes: positions computed[i] .. + num_rows[i] - 1
    computed: list = field(default_factory=list)  # tokens of each in the caches before this step
    sampled: list = field(default_factory=list)  # SampledRow, in row order
    finished: list = field(default_factory=list)  # rids that left (finished, aborted, preempted)
    new: list = field(default_factory=list)  # NewRequest
    grants: list = field(default_factory=list)  # (rid, block ids): blocks appended to a running request's
    tokens: dict = field(default_factory=dict)  # rid -> [(index, token)]: tokens sampled before, not computed yet
    preempted: list = field(default_factory=list)  # rids preempted by this step (also in finished)
    prefill_chunks: int = 0  # requests computing more than their last token
    num_drafts: list = field(default_factory=list)  # per request, the draft rows after its last token (the
    # scheduler-visible spec tokens of a verify step: num_rows = 1 + num_drafts; 0 without speculation)

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_rows)


@dataclass
class _Picks:
    """A step while it is being scheduled."""
    requests: list = field(default_factory=list)
    num_rows: list = field(default_factory=list)
    drafts: dict = field(default_factory=dict)  # rid -> draft rows of a decode request
    new: list = field(default_factory=list)  # Request
    grants: list = field(default_factory=list)
    preempted: list = field(default_factory=list)

    def add(self, req: Request, rows: int) -> None:
        self.requests.append(req)
        self.num_rows.append(rows)

    def drop(self, req: Request) -> None:
        """A request preempted by this step: none of its rows or blocks reach the runner."""
        if req in self.requests:
            i = self.requests.index(req)
            del self.requests[i], self.num_rows[i]
        self.grants = [g for g in self.grants if g[0] != req.rid]
        if req in self.new:
            self.new.remove(req)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_batch_tokens: int, *, max_num_seqs: int = 256,
                 prefix_caching: bool = True, namespace: str = "", speculative_tokens: int = 0):
        self.speculative_tokens = speculative_tokens  # draft rows per decode request (fewer near its length limit)
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.blocks = BlockManager(num_blocks, block_size, namespace, prefix_caching)
        self.waiting: deque = deque()
        self.running: dict = {}  # rid -> Request, in admission order
        # what the runner has not heard yet; it goes with the next step that runs (an empty one runs nothing)
        self._left: list = []  # rids of running requests that left
        self._tokens: dict = {}  # rid -> [(index, token)] of running requests, for rows not computed yet
        self._placed: list = []  # Request moved to running by run_as_prefilled

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.block_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows (module docstring): decode rows, then prefill chunks. The rows count
        as computed from here on, and a row that reaches its request's last token samples the next
        one (PENDING in its tokens until :meth:`update`)."""
        picks = _Picks(new=self._placed)
        self._placed = []
        budget = self.max_batch_tokens
        for req in list(self.running.values()):  # decode rows, oldest first
            if req.rid not in self.running or req.prefilling or req.done or budget == 0:
                continue
            k = self._drafts(req, budget)
            if not self._grow(req, req.computed + 1 + k, picks):
                continue  # it preempted itself
            picks.add(req, 1 + k)
            if k:
                picks.drafts[req.rid] = k
            budget -= 1 + k
        for req in list(self.running.values()):  # prefill chunks of running requests
            if budget == 0:
                break
            if req.prefilling and req.rid in self.running:
                n = self._chunk(req, budget, picks)
                if n:
                    picks.add(req, n)
                    budget -= n
        if not picks.preempted:  # admitting while preempting would only thrash
            self._admit(picks, budget)
        return self._output(picks)

    def _drafts(self, req: Request, budget: int) -> int:
        """Draft rows for a decode request: ``speculative_tokens``, fewer when its length limit or the
        step's row budget leaves less room (a verify step brings at most drafts + 1 tokens)."""
        left = req.max_new_tokens - (len(req.tokens) - req.prompt_len)  # >= 1: it is not done
        return max(0, min(self.speculative_tokens, left - 1, budget - 1))

    def _output(self, picks: _Picks) -> SchedulerOutput:
        out = SchedulerOutput(preempted=picks.preempted)
        if not picks.requests:  # nothing runs: what the runner must hear waits for a step that does
            self._placed = picks.new
            return out
        out.new = [NewRequest(r.rid, list(r.tokens), list(r.blocks), r.sampling, r.seed) for r in picks.new]
        out.grants, out.num_rows = picks.grants, picks.num_rows
        out.finished, self._left = self._left, []
        out.tokens, self._tokens = self._tokens, {}
        for i, (req, n) in enumerate(zip(picks.requests, picks.num_rows)):
            k = picks.drafts.get(req.rid, 0)
            out.rids.append(req.rid)
            out.computed.append(req.computed)
            out.num_drafts.append(k)
            out.prefill_chunks += req.prefilling
            req.computed += n - k  # draft rows count once accepted (update)
            if req.computed == len(req.tokens):  # the row of its last token: the next one is sampled
                req.tokens.append(PENDING)
                out.sampled.append(SampledRow(i, req, req.computed, req.done, k))
        return out

    def _fit(self, req: Request, rows: int) -> int:
        """How many of ``rows`` next rows of ``req`` its blocks and the free ones can hold."""
        return min(rows, (len(req.blocks) + self.blocks.num_free) * self.block_size - req.computed)

    def _chunk(self, req: Request, budget: int, picks: _Picks) -> int:
        """Rows of a running prefill this step (at most ``budget``), shrunk to the blocks it can
        get; when not one row fits, newer requests are preempted (0: it was preempted itself)."""
        n = self._fit(req, min(req.uncomputed, budget))
        if n <= 0:
            if not self._grow(req, req.computed + 1, picks):
                return 0
            n = self._fit(req, min(req.uncomputed, budget))
        self._give(req, self.blocks.grow(req, req.computed + n), picks)
        return n

    def _grow(self, req: Request, tokens: int, picks: _Picks) -> bool:
        """Blocks for ``req``'s first ``tokens`` tokens, preempting the newest running requests when
        the pool is out; False when ``req`` itself had to go."""
        while True:
            try:
                blocks = self.blocks.grow(req, tokens)
            except CacheFullError:
                victim = next(reversed(self.running.values()))
                self._preempt(victim, picks)
                if victim is req:
                    return False
                continue
            self._give(req, blocks, picks)
            return True

    def _give(self, req: Request, blocks: list, picks: _Picks) -> None:
        """Blocks for a running request the runner knows already: a grant of this step."""
        if blocks:
            req.blocks += blocks
            picks.grants.append((req.rid, blocks))

    def _preempt(self, req: Request, picks: _Picks) -> None:
        """Free a running request's blocks and put it at the front of the queue to recompute."""
        self._release(req)
        req.computed, req.block_names, req.chain = 0, [], None
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        picks.preempted.append(req.rid)
        picks.drop(req)

    def _release(self, req: Request) -> None:
        """A running request leaves: its blocks go back (cached ones stay cached), the runner hears."""
        self.blocks.free(req)
        req.blocks = []
        del self.running[req.rid]
        self._left.append(req.rid)
        self._tokens.pop(req.rid, None)

    def _admit(self, picks: _Picks, budget: int) -> None:
        """Admit waiting requests in order while blocks and ``budget`` last; a request whose prefix
        is being computed by a running one waits for it (later ones may go ahead)."""
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.chain is None:
                req.chain = self.blocks.chain(req.tokens)
            if self.blocks.in_flight_prefix(req):
                deferred.append(self.waiting.popleft())
                continue
            hit = self.blocks.allocate(req)  # its cached prefix
            req.blocks, req.block_names, req.computed = hit, req.chain[:len(hit)], len(hit) * self.block_size
            n = self._fit(req, min(req.uncomputed, budget))
            if n <= 0:  # not even one row fits: give the prefix back and wait
                self.blocks.free(req)
                req.blocks, req.computed, req.block_names = [], 0, []
                break
            req.blocks += self.blocks.grow(req, req.computed + n)
            self.blocks.count_admission(req)
            self.running[self.waiting.popleft().rid] = req
            picks.new.append(req)
            picks.add(req, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def run_as_prefilled(self, req: Request) -> None:
        """Move waiting ``req`` to running as if all its tokens but the last were in the caches,
        their rows written by someone else (a benchmark's stand-in rows): blocks for all its
        tokens; its first step computes its last token (a decode row) and samples."""
        if len(self.running) >= self.max_num_seqs:
            raise RuntimeError(f"run_as_prefilled: {self.max_num_seqs} requests (max_num_seqs) run already")
        self.waiting.remove(req)
        req.chain = self.blocks.chain(req.tokens)
        req.blocks = self.blocks.grow(req, len(req.tokens))
        req.computed = len(req.tokens) - 1
        self.running[req.rid] = req
        self._placed.append(req)

    def update(self, results: list) -> None:
        """A finished step's tokens reach the requests: ``results`` is ``(SampledRow, token, stop)``
        for each sampled row of a request still live (running, or waiting after a preemption), in
        row order; ``token`` is a list after a verify step (its accepted drafts, then one more), whose
        accepted rows become computed (the rejected rows' cache entries are past ``computed``: never
        read, overwritten by the next step, never named). Each token takes its PENDING place and names the blocks it completes; a
        request whose ``stop`` is true ends with it and leaves (a later row's token, if one is in
        flight, is dropped)."""
        for s, token, stop in results:
            req = s.request
            tokens = token if isinstance(token, list) else [token]  # a verify step's accepted drafts + one
            req.tokens[s.index:s.index + 1] = tokens
            running = req.rid in self.running
            needed = s.index >= req.computed  # no launched row has read it: the runner needs it
            if running:
                req.computed += len(tokens) - 1  # the accepted drafts' rows; the rejected ones are forgotten
                req.block_names += self.blocks.name_full_blocks(req)
            if stop:
                self.remove(req)
                del req.tokens[s.index + len(tokens):]
            elif running and needed:
                self._tokens.setdefault(req.rid, []).extend((s.index + j, t) for j, t in enumerate(tokens))

    def remove(self, req: Request) -> bool:
        """Take a request out wherever it is (running: its blocks are released); False if it is in neither."""
        if req.rid in self.running:
            self._release(req)
            return True
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True
