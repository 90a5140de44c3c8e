"""Scheduler: the waiting and running requests, their blocks, and the rows each step computes.

Each step (:meth:`Scheduler.schedule`) first gives every running request whose tokens are all
computed but its last one a decode row, growing its blocks by one when a block fills; when the
pool runs out, the most recently admitted running request is preempted (its blocks freed, it goes
back to the front of the queue and recomputes its prompt and generated tokens later; the tokens it
produced stay). Then the rest of ``max_batch_tokens`` goes to prefill chunks: running requests
first, oldest first, then waiting requests, admitted in order as far as blocks and
``max_num_seqs`` allow (a request gets blocks for the rows it computes, not for its worst case). A waiting request whose next
uncached prompt block is being computed by a running request waits for it rather than compute it
twice (in-flight prefix sharing). The result is a :class:`SchedulerOutput`; a request leaves by
:meth:`finish` (running) or :meth:`remove` (anywhere), which release its blocks at once.
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
    computed: int = 0  # tokens whose latent rows and indexer keys are in the caches
    num_preemptions: int = 0
    # what the engine needs to sample and report (the scheduler does not read these)
    sampling: SamplingParams = GREEDY
    seed: int = 0  # the noise key of its sampled tokens
    text: object = None  # TextOutput, when the engine has a tokenizer
    on_output: object = None  # callable(Delta), called by whichever thread steps; must not raise

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]

    @property
    def uncomputed(self) -> int:
        """Tokens still to compute: 1 for a decode row, more while (re)filling the caches."""
        return len(self.tokens) - self.computed

    @property
    def prefilling(self) -> bool:
        return self.uncomputed > 1

    @property
    def done(self) -> bool:
        """It has all the tokens it may generate (the last maybe still pending): no more rows."""
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


@dataclass
class SchedulerOutput:
    """One step: the requests that compute rows, in row order, and what changed since the last step."""
    requests: list  # Request, decode rows first, then prefill chunks
    num_rows: list  # rows each request computes: tokens[computed : computed + n]
    admitted: list = field(default_factory=list)  # Request admitted (or resumed) this step, with their blocks
    preempted: list = field(default_factory=list)  # Request that lost their blocks this step (requeued)
    finished: list = field(default_factory=list)  # rids that left (finished, aborted, preempted) since the last run

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_rows)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_batch_tokens: int, *, max_num_seqs: int = 256,
                 prefix_caching: bool = True, namespace: str = ""):
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.blocks = BlockManager(num_blocks, block_size, namespace, prefix_caching)
        self.waiting: deque = deque()
        self.running: dict = {}  # rid -> Request, in admission order
        self.num_preemptions = 0
        self._left: list = []  # rids of running requests that left since the last step that ran

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.block_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows (module docstring): decode rows, then prefill chunks."""
        out = SchedulerOutput([], [])
        budget = self.max_batch_tokens
        for req in list(self.running.values()):  # decode rows, oldest first
            if req.rid not in self.running or req.prefilling or req.done or budget == 0:
                continue
            if not self._grow(req, req.computed + 1, out):
                continue  # it preempted itself
            out.requests.append(req)
            out.num_rows.append(1)
            budget -= 1
        for req in list(self.running.values()):  # prefill chunks of running requests
            if budget == 0:
                break
            if req.prefilling and req.rid in self.running:
                n = self._chunk(req, budget, out)
                if n:
                    out.requests.append(req)
                    out.num_rows.append(n)
                    budget -= n
        if not out.preempted:  # admitting while preempting would only thrash
            self._admit(out, budget)
        if out:  # the rids that left reach the runner with the next step it runs (an empty one runs nothing)
            out.finished, self._left = self._left, []
        return out

    def _fit(self, req: Request, rows: int) -> int:
        """How many of ``rows`` next rows of ``req`` its blocks and the free ones can hold."""
        return min(rows, (len(req.blocks) + self.blocks.num_free) * self.block_size - req.computed)

    def _chunk(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Rows of a running prefill this step (at most ``budget``), shrunk to the blocks it can
        get; when not one row fits, newer requests are preempted (0: it was preempted itself)."""
        n = self._fit(req, min(req.uncomputed, budget))
        if n <= 0:
            if not self._grow(req, req.computed + 1, out):
                return 0
            n = self._fit(req, min(req.uncomputed, budget))
        self.blocks.grow(req, req.computed + n)
        return n

    def _grow(self, req: Request, tokens: int, out: SchedulerOutput) -> bool:
        """Blocks for ``req``'s first ``tokens`` tokens, preempting the newest running requests when
        the pool is out; False when ``req`` itself had to go."""
        while True:
            try:
                self.blocks.grow(req, tokens)
                return True
            except CacheFullError:
                victim = next(reversed(self.running.values()))
                self.preempt(victim, out)
                if victim is req:
                    return False

    def preempt(self, req: Request, out: SchedulerOutput | None = None) -> None:
        """Free a running request's blocks and put it at the front of the queue to recompute."""
        self.blocks.free(req)
        del self.running[req.rid]
        self._left.append(req.rid)
        req.computed, req.block_names, req.chain = 0, [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if out is not None:
            out.preempted.append(req)
            if req in out.requests:
                i = out.requests.index(req)
                del out.requests[i], out.num_rows[i]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while blocks and ``budget`` last; a request whose prefix
        is being computed by a running one waits for it (later ones may go ahead)."""
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.blocks.in_flight_prefix(req):
                deferred.append(self.waiting.popleft())
                continue
            self.blocks.allocate(req)  # its cached prefix
            n = self._fit(req, min(req.uncomputed, budget))
            if n <= 0:  # not even one row fits: give the prefix back and wait
                self.blocks.free(req)
                req.computed, req.block_names = 0, []
                break
            self.blocks.grow(req, req.computed + n)
            self.blocks.count_admission(req)
            self.running[self.waiting.popleft().rid] = req
            out.admitted.append(req)
            out.requests.append(req)
            out.num_rows.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def advance(self, req: Request, rows: int) -> None:
        """``rows`` more tokens of ``req`` are in the caches once the launched step runs (their full
        blocks are named later, by :meth:`name_blocks`, when every token in them is known)."""
        req.computed += rows

    def name_blocks(self, req: Request) -> None:
        """Prefix-cache names for ``req``'s computed full blocks (its tokens up to ``computed`` known)."""
        if req.rid in self.running:
            self.blocks.name_full_blocks(req)

    def finish(self, req: Request) -> None:
        """Release a running request's blocks (cached ones stay cached) and forget it."""
        self.blocks.free(req)
        del self.running[req.rid]
        self._left.append(req.rid)

    def remove(self, req: Request) -> bool:
        """Take a request out wherever it is (running: its blocks are released); False if it is in neither."""
        if req.rid in self.running:
            self.finish(req)
            return True
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True
