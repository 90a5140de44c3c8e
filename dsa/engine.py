"""Engine: the long-context inference API, batching requests over shared paged caches.

A request reserves blocks for ``len(prompt) + max_new_tokens`` when it is admitted (no
preemption, no deadlock); requests that do not fit yet wait in order; one that could never fit
is refused at ``add_request``. Each step serves every decoding request one token, then fills the
rest of ``max_batch_tokens`` with prefill chunks. Sampling is greedy.

Batch invariance: every op a row goes through depends on that row alone (the top-k's tie rule
gives the lowest positions at the k-th value, whatever the row's padding or batch), so in float32
a request's tokens are the same alone, in any batch, in any order and at any chunk size, up to
floating-point near-ties of the projections (batched and single-row matmuls differ by ~1e-5).
"""
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from dsa.cache import BlockAllocator, CacheFullError
from dsa.kernels.common import check_int

from .config import bytes_per_token
from .plan import PATHS


@dataclass
class _Request:
    rid: int
    tokens: list  # prompt, then generated tokens
    prompt_len: int
    max_new_tokens: int
    blocks: list = field(default_factory=list)
    computed: int = 0  # tokens whose latent rows are in the caches

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]


class Engine:
    def __init__(self, model, num_blocks: int | None = None, memory_bytes: int | None = None,
                 max_batch_tokens: int = 8192):
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("num_blocks / memory_bytes: give exactly one of them")
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        self.model = model
        self.config = c = model.config
        if num_blocks is None:
            num_blocks = int(memory_bytes) // (bytes_per_token(c, model.dtype) * c.block_size)
        num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.num_blocks = num_blocks
        self.max_batch_tokens = max_batch_tokens
        self.caches = model.allocate_caches(num_blocks)
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: deque = deque()
        self.running: dict = {}
        self._ids = itertools.count()
        eos = c.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.stats = {"rows": {p: 0 for p in PATHS}, "prefill_chunks": 0, "peak_workspace_bytes": 0,
                      "blocks_in_use": 0, "steps": 0, "tokens": 0}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def add_request(self, prompt_ids, max_new_tokens: int) -> int:
        """Queue a prompt (token ids); returns its request id. Raises ValueError if it can never fit."""
        prompt = token_ids(prompt_ids, self.config.vocab_size)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        total = len(prompt) + max_new_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(f"prompt_ids: {len(prompt)} + max_new_tokens {max_new_tokens} = {total} tokens exceed "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        if self._blocks_for(total) > self.num_blocks:
            raise ValueError(f"prompt_ids: {total} tokens need {self._blocks_for(total)} blocks; the engine holds "
                             f"{self.num_blocks} ({self.capacity_tokens} tokens)")
        req = _Request(next(self._ids), prompt, len(prompt), max_new_tokens)
        self.waiting.append(req)
        return req.rid

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            try:
                req.blocks = self.allocator.allocate(self._blocks_for(len(req.tokens) + req.max_new_tokens))
            except CacheFullError:
                return  # in order: later requests wait behind it
            self.running[self.waiting.popleft().rid] = req

    def step(self) -> dict:
        """Run one batch; returns ``{request id: [tokens produced this step]}``."""
        self._admit()
        batch, budget = [], self.max_batch_tokens
        decoding = [r for r in self.running.values() if r.computed >= r.prompt_len]
        prefilling = [r for r in self.running.values() if r.computed < r.prompt_len]
        for req in decoding + prefilling:
            n = 1 if req.computed >= req.prompt_len else min(req.prompt_len - req.computed, budget)
            if n <= 0 or budget <= 0:
                break
            batch.append((req, n))
            budget -= n
        if not batch:
            return {}
        chunks = sum(1 for r, _ in batch if r.computed < r.prompt_len)
        model = self.model
        plan = model.plan([n for _, n in batch], [r.computed for r, _ in batch], [r.blocks for r, _ in batch])
        ids = torch.tensor([t for r, n in batch for t in r.tokens[r.computed:r.computed + n]], dtype=torch.long)
        ends = torch.tensor(list(itertools.accumulate(n for _, n in batch))) - 1  # last row of each request
        step_stats = {}
        logits = model.step(ids, plan, self.caches, logits_rows=ends.to(model.device), stats=step_stats)
        nxt = logits.argmax(-1).tolist()
        produced = {}
        for (req, n), tok in zip(batch, nxt):
            req.computed += n
            if req.computed < len(req.tokens):
                continue  # a prefill chunk that did not reach the end of the prompt
            req.tokens.append(tok)
            produced[req.rid] = [tok]
            if len(req.generated) >= req.max_new_tokens or tok in self.eos:
                self.allocator.free(req.blocks)
                del self.running[req.rid]
        for path, rows in plan.row_counts().items():
            self.stats["rows"][path] += rows
        self.stats["prefill_chunks"] += chunks
        self.stats["peak_workspace_bytes"] = max(self.stats["peak_workspace_bytes"], step_stats.get("workspace_bytes", 0))
        self.stats["blocks_in_use"] = self.num_blocks - self.allocator.num_free
        self.stats["steps"] += 1
        self.stats["tokens"] += len(ids)
        return produced

    def generate(self, prompts, max_new_tokens: int) -> list:
        """Greedy completions (generated tokens only) of each prompt, in order."""
        rids = [self.add_request(p, max_new_tokens) for p in prompts]
        out = {rid: [] for rid in rids}
        pending = set(rids)
        while pending:
            produced = self.step()
            if not produced and not self.running:
                raise RuntimeError("engine: requests are waiting but none can be scheduled")
            for rid, toks in produced.items():
                if rid in out:
                    out[rid].extend(toks)
            waiting = {r.rid for r in self.waiting}
            pending = {r for r in pending if r in self.running or r in waiting}
        return [out[r] for r in rids]


def token_ids(prompt_ids, vocab_size: int) -> list:
    """A prompt as a list of ints in ``[0, vocab_size)``, at least one; ``TypeError`` for floats and
    bools (a float tensor too), ``ValueError`` for an empty prompt or ids out of range."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise TypeError(f"prompt_ids: expected integer token ids, got a {prompt_ids.dtype} tensor")
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids: expected a 1-D tensor, got shape {list(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    elif isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids: expected integer token ids, got {type(prompt_ids).__name__}")
    prompt = [check_int("prompt_ids", t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids: expected at least one token")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab_size})")
    return prompt
