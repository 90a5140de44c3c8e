"""Engine: the long-context inference API, batching requests over shared paged caches.

Three small objects (as nano-vllm splits them): the :class:`~dsa.scheduler.Scheduler` (waiting and
running requests, their blocks, which rows each step serves), the :class:`~dsa.runner.ModelRunner`
(the caches; plans a step and runs it, replaying a CUDA graph for decode-only steps) and the
sampling here. Sampling is greedy.

Batch invariance: every op a row goes through depends on that row alone (the top-k's tie rule
gives the lowest positions at the k-th value, whatever the row's padding or batch; a decode row's
kernel depends on the model, not on the batch), so in float32 a request's tokens are the same
alone, in any batch, in any order and at any chunk size, up to floating-point near-ties of the
projections (batched and single-row matmuls differ by ~1e-5).
"""
import itertools

import torch

from dsa.kernels.common import check_int

from .config import bytes_per_token
from .plan import PATHS
from .runner import ModelRunner
from .scheduler import Request, Scheduler


class Engine:
    """Batches requests over one pool of paged caches (``num_blocks`` blocks, or as many as
    ``memory_bytes`` holds) and generates greedily; ``max_batch_tokens`` rows per step (long
    prompts are prefilled in chunks). ``cuda_graphs``: replay decode-only steps from CUDA graphs
    (None: whenever the model allows, i.e. on CUDA without MoE layers; False: always eager).
    ``prefix_caching``: reuse the cached blocks of a prompt's prefix (both caches of every layer)
    and keep finished requests' blocks cached until the pool needs them."""

    def __init__(self, model, num_blocks: int | None = None, memory_bytes: int | None = None,
                 max_batch_tokens: int = 8192, cuda_graphs: bool | None = None, prefix_caching: bool = True):
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("num_blocks / memory_bytes: give exactly one of them")
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        self.model = model
        self.config = c = model.config
        if num_blocks is None:
            num_blocks = int(memory_bytes) // (bytes_per_token(c, model.dtype) * c.block_size)
        num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.num_blocks = num_blocks
        namespace = repr((c, str(model.dtype)))  # what changes a block's content besides its tokens
        self.scheduler = Scheduler(num_blocks, c.block_size, max_batch_tokens, prefix_caching=prefix_caching,
                                   namespace=namespace)
        self.runner = ModelRunner(model, num_blocks, cuda_graphs)
        self._ids = itertools.count()
        eos = c.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.stats = {"rows": {p: 0 for p in PATHS}, "prefill_chunks": 0, "peak_workspace_bytes": 0,
                      "blocks_in_use": 0, "steps": 0, "graph_steps": 0, "tokens": 0,
                      "prefix": dict(self.scheduler.blocks.stats, cached_blocks=0)}

    # ---- state the tests and tools look at ------------------------------------------------
    @property
    def caches(self):
        return self.runner.caches

    @property
    def allocator(self):
        """The block pool (``num_free``: blocks a new request can get, cached ones included)."""
        return self.scheduler.blocks

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids, max_new_tokens: int) -> int:
        """Queue a prompt (token ids); returns its request id. Raises ValueError if it can never fit."""
        prompt = token_ids(prompt_ids, self.config.vocab_size)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
        total = len(prompt) + max_new_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(f"prompt_ids: {len(prompt)} + max_new_tokens {max_new_tokens} = {total} tokens exceed "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        blocks = self.scheduler.blocks_for(total)
        if blocks > self.num_blocks:
            raise ValueError(f"prompt_ids: {total} tokens need {blocks} blocks; the engine holds "
                             f"{self.num_blocks} ({self.capacity_tokens} tokens)")
        req = Request(next(self._ids), prompt, len(prompt), max_new_tokens)
        self.scheduler.add(req)
        return req.rid

    def step(self) -> dict:
        """Run one batch; returns ``{request id: [tokens produced this step]}``."""
        batch = self.scheduler.schedule()
        if not batch:
            return {}
        result = self.runner.run(batch)
        tokens = result.logits.argmax(-1).tolist()  # the step's one device-to-host copy
        produced = {}
        for (req, n), tok in zip(batch, tokens):
            self.scheduler.advance(req, n)
            if req.computed < len(req.tokens):
                continue  # a prefill chunk that did not reach the end of the prompt
            req.tokens.append(tok)
            produced[req.rid] = [tok]
            if len(req.generated) >= req.max_new_tokens or tok in self.eos:
                self.scheduler.finish(req)
        s = self.stats
        for path, rows in result.rows.items():
            s["rows"][path] += rows
        s["prefill_chunks"] += sum(1 for r, n in batch if r.computed - n < r.prompt_len)
        s["peak_workspace_bytes"] = max(s["peak_workspace_bytes"], result.workspace_bytes)
        s["blocks_in_use"] = self.num_blocks - self.allocator.num_free
        s["prefix"] = dict(self.scheduler.blocks.stats, cached_blocks=self.scheduler.blocks.num_cached)
        s["steps"] += 1
        s["graph_steps"] += result.graph
        s["tokens"] += sum(n for _, n in batch)
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
