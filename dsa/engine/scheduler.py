"""Scheduler: the waiting and running requests, their blocks, and the rows each step serves.

A request reserves blocks for ``len(prompt) + max_new_tokens`` when it is admitted (no preemption,
no deadlock), reusing the cached blocks of its prompt's prefix (:class:`dsa.engine.blocks.BlockManager`);
requests that do not fit yet wait in order. Each step serves every decoding request one token, then
fills the rest of ``max_batch_tokens`` with prefill chunks, oldest first. A request leaves by
:meth:`Scheduler.finish` (running) or :meth:`Scheduler.remove` (running or waiting); either
releases its blocks at once.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dsa.engine.blocks import BlockManager, CacheFullError
from dsa.engine.sampling import GREEDY, SamplingParams
from dsa.kernels.common import cdiv


@dataclass(eq=False)
class Request:
    rid: int
    tokens: list  # prompt, then generated tokens
    prompt_len: int
    max_new_tokens: int
    blocks: list = field(default_factory=list)
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # blocks, for the step plan
    block_names: list = field(default_factory=list)  # prefix-cache names of its full blocks, in order
    computed: int = 0  # tokens whose latent rows and indexer keys are in the caches
    # what the engine needs to sample and report (the scheduler does not read these)
    sampling: SamplingParams = GREEDY
    seed: int = 0  # the noise key of its sampled tokens
    text: object = None  # TextOutput, when the engine has a tokenizer
    on_output: object = None  # callable(Delta), called by whichever thread steps; must not raise

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_batch_tokens: int, *, prefix_caching: bool = True,
                 namespace: str = ""):
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.blocks = BlockManager(num_blocks, block_size, namespace, prefix_caching)
        self.waiting: deque = deque()
        self.running: dict = {}  # rid -> Request, in admission order

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.block_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            try:
                self.blocks.allocate(req, len(req.tokens) + req.max_new_tokens)
            except CacheFullError:
                return  # in order: later requests wait behind it
            req.block_array = np.asarray(req.blocks, dtype=np.int32)
            self.running[self.waiting.popleft().rid] = req

    def schedule(self) -> list:
        """Admit what fits, then pick this step's ``[(request, new rows)]``: decode rows first."""
        self._admit()
        decode, prefill = [], []
        for req in self.running.values():
            (prefill if req.computed < req.prompt_len else decode).append(req)
        batch = [(req, 1) for req in decode[:self.max_batch_tokens]]
        budget = self.max_batch_tokens - len(batch)
        for req in prefill:
            if budget <= 0:
                break
            n = min(req.prompt_len - req.computed, budget)
            batch.append((req, n))
            budget -= n
        return batch

    def advance(self, req: Request, rows: int) -> None:
        """``rows`` more tokens of ``req`` are in the caches (its full blocks get prefix-cache names)."""
        req.computed += rows
        self.blocks.name_full_blocks(req)

    def finish(self, req: Request) -> None:
        """Release a running request's blocks (cached ones stay cached) and forget it."""
        self.blocks.free(req)
        req.block_array = np.zeros(0, np.int32)
        del self.running[req.rid]

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
