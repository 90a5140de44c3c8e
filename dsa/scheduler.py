"""Scheduler: the waiting and running requests, their blocks, and the rows each step serves.

A request reserves blocks for ``len(prompt) + max_new_tokens`` when it is admitted (no preemption,
no deadlock); requests that do not fit yet wait in order. Each step serves every decoding request
one token, then fills the rest of ``max_batch_tokens`` with prefill chunks, oldest first. A request
leaves by :meth:`Scheduler.finish` (running) or :meth:`Scheduler.remove` (running or waiting);
either frees its blocks at once.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dsa.cache import BlockAllocator, CacheFullError


@dataclass(eq=False)
class Request:
    rid: int
    tokens: list  # prompt, then generated tokens
    prompt_len: int
    max_new_tokens: int
    blocks: list = field(default_factory=list)
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # blocks, for the step plan
    computed: int = 0  # tokens whose latent rows are in the caches
    # what the engine needs to sample and report (the scheduler does not read these)
    sampling: object = None  # SamplingParams
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
    def __init__(self, num_blocks: int, block_size: int, max_batch_tokens: int):
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: deque = deque()
        self.running: dict = {}  # rid -> Request, in admission order

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            try:
                req.blocks = self.allocator.allocate(self.blocks_for(len(req.tokens) + req.max_new_tokens))
            except CacheFullError:
                return  # in order: later requests wait behind it
            req.block_array = np.asarray(req.blocks, dtype=np.int32)
            self.running[self.waiting.popleft().rid] = req

    def schedule(self) -> list:
        """Admit what fits, then pick this step's ``[(request, new rows)]``: decode rows first."""
        self._admit()
        batch, budget = [], self.max_batch_tokens
        reqs = self.running.values()
        for req in [r for r in reqs if not r.prefilling] + [r for r in reqs if r.prefilling]:
            n = min(req.prompt_len - req.computed, budget) if req.prefilling else 1
            if n <= 0 or budget <= 0:
                break
            batch.append((req, n))
            budget -= n
        return batch

    def finish(self, req: Request) -> None:
        """Free a running request's blocks and forget it."""
        self.allocator.free(req.blocks)
        req.blocks, req.block_array = [], np.zeros(0, np.int32)
        del self.running[req.rid]

    def remove(self, req: Request) -> bool:
        """Take a request out wherever it is (running: its blocks are freed); False if it is in neither."""
        if req.rid in self.running:
            self.finish(req)
            return True
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True
