"""A stub model for the engine's bookkeeping tests: what the runner and the engine use of a model
(config, caches, plan options, ``step``) with no kernels, so an Engine runs a step in a millisecond.

Its cache holds each position's token id. A step writes its rows' ids at the plan's slots, reads
back every position each request sees through the plan's block table and returns, per request,
logits that are a function of those ids alone (a weighted sum of them, hashed over the
vocabulary; no two logits of a row tie). A wrong block table, id, slot or length therefore changes
the tokens, and a position read before any step wrote it fails at once. :func:`reference` gives
the greedy tokens of a prompt from the same function, with no engine.
"""
import numpy as np
import torch

from dsa.config import DSAConfig
from dsa.model.plan import PlanOptions

VOCAB = 64
_WEIGHTS = np.random.default_rng(0).integers(1, 1 << 20, 4096)  # per position


def stub_config(**overrides) -> DSAConfig:
    """A tiny config (block size 16, no EOS) whose tokens mirror the stub's few positions."""
    return DSAConfig.tiny(**{"vocab_size": VOCAB, "max_position_embeddings": 1024, "eos_token_id": None,
                             **overrides})


def _logits(sums: np.ndarray) -> np.ndarray:
    """``[B, V]`` logits of each row's weighted sum of ids (values in [0, 10), distinct per row)."""
    v = np.arange(VOCAB)
    return (((sums[:, None] % 65521) * 2654435761 + v[None, :] * 40503) % 65521 / 6552.1).astype(np.float32)


def _weighted(ids: np.ndarray) -> np.ndarray:
    """The weighted sums of ``ids [B, S]`` (int64, -1 past a row's end)."""
    w = _WEIGHTS[:ids.shape[1]]
    return np.where(ids >= 0, (ids + 1) * w, 0).sum(axis=1)


def reference(prompt: list, new_tokens: int) -> list:
    """The greedy tokens the stub gives after ``prompt``, computed without an engine."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(_logits(_weighted(np.asarray([tokens])))[0].argmax()))
    return tokens[len(prompt):]


class StubCaches:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.tokens = np.full(num_blocks * block_size, -1, np.int64)  # -1: never written


class StubModel:
    def __init__(self, config: DSAConfig | None = None):
        self.config = config or stub_config()
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.steps = 0

    def modules(self):
        return iter(())

    def allocate_caches(self, num_blocks: int) -> StubCaches:
        return StubCaches(num_blocks, self.config.block_size)

    def plan_options(self) -> PlanOptions:
        return PlanOptions(index_topk=None)  # every row dense: no indexer routing to plan

    def step(self, plan, caches: StubCaches, logits_rows=None) -> torch.Tensor:
        self.steps += 1
        p = self.config.block_size
        slots, ids = plan.slot_mapping.numpy().astype(np.int64), plan.input_ids.numpy().astype(np.int64)
        if (ids < 0).any() or (slots < 0).any():
            raise AssertionError(f"step: rows with no id or no slot: ids {ids.tolist()}, slots {slots.tolist()}")
        caches.tokens[slots] = ids
        lens = plan.seq_lens.numpy().astype(np.int64)[:len(plan.query_lens)]
        table = plan.block_table.numpy().astype(np.int64)[:len(lens)]
        pos = np.arange(max(int(lens.max()), 1))
        seen = pos[None, :] < lens[:, None]
        where = table[:, np.minimum(pos // p, table.shape[1] - 1)] * p + pos % p
        read = np.where(seen, caches.tokens[where], -1)
        if (read[seen] < 0).any():
            raise AssertionError(f"step: a request reads a position no step wrote (seq_lens {lens.tolist()})")
        return torch.from_numpy(_logits(_weighted(read)))
