"""BlockManager: one engine's cache blocks, with automatic prefix caching.

Every layer's latent cache and indexer key cache share one block numbering, so a block id names
the same tokens in both: reusing a block reuses the latent rows and the indexer keys together.

A block whose ``P`` tokens are all computed gets a name, a chain hash
``sha256(previous block's name | P token ids)`` seeded with the engine's namespace (model shapes,
dtype, cache formats), so equal names mean equal token prefixes. A new request reuses the longest
run of named blocks that starts its prompt, except the block holding the prompt's last token, which
is always recomputed (its logits are needed, and a shared block is never written again). Blocks
count their requests; a named block whose requests finished stays cached, least recently used
first out, until the pool needs it; a block in use is never evicted.

Free blocks are a stack (allocate and free are O(1) per block; a fresh pool hands out the lowest
ids first).
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dsa.kernels.common import cdiv, check_int


class CacheFullError(RuntimeError):
    """The pool has fewer free blocks than a request asked for; nothing was allocated."""


@dataclass
class PrefixStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of them, found in the prefix cache (hit rate = hit_tokens / prompt_tokens)
    evictions: int = 0  # cached blocks given to new requests
    cached_blocks: int = 0  # blocks with a prefix-cache name now


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str = "", prefix_caching: bool = True):
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack of never-used or freed unnamed blocks
        self.seed = hashlib.sha256(namespace.encode()).digest()
        self.refs: dict = {}  # block -> requests holding it
        self.by_name: dict = {}  # name -> block
        self.name_of: dict = {}  # block -> name
        self.evictable: OrderedDict = OrderedDict()  # named blocks no request holds, least recently used first
        self._stats = PrefixStats()

    @property
    def stats(self) -> PrefixStats:
        self._stats.cached_blocks = len(self.name_of)
        return self._stats

    @property
    def num_free(self) -> int:
        """Blocks a request can get: never used, or cached and held by no request."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return len(self.refs)

    def _name(self, previous: bytes, tokens: np.ndarray) -> bytes:
        return hashlib.sha256(previous + tokens.tobytes()).digest()

    def _cached_prefix(self, tokens: list, prompt_len: int) -> tuple[list, list]:
        """Blocks and names of the longest cached run of full blocks starting the prompt (never the
        block of the prompt's last token)."""
        blocks, names, previous, p = [], [], self.seed, self.block_size
        full = (prompt_len - 1) // p
        ids = np.asarray(tokens[:full * p], dtype=np.int64)  # one conversion, then a view per block
        for i in range(full):
            name = self._name(previous, ids[i * p:(i + 1) * p])
            block = self.by_name.get(name)
            if block is None:
                break
            blocks.append(block)
            names.append(name)
            previous = name
        return blocks, names

    def allocate(self, req, total_tokens: int) -> None:
        """Give ``req`` blocks for ``total_tokens``: its cached prefix plus new ones; sets
        ``req.blocks``, ``req.block_names`` and ``req.computed`` (the reused tokens). Raises
        :class:`CacheFullError` and changes nothing when the pool cannot serve it."""
        hit, names = self._cached_prefix(req.tokens, req.prompt_len) if self.prefix_caching else ([], [])
        need = cdiv(total_tokens, self.block_size) - len(hit)
        reused = set(hit)
        available = len(self.free_ids) + sum(1 for b in self.evictable if b not in reused)
        if need > available:
            raise CacheFullError(f"asked for {need} blocks, {available} of {self.num_blocks} can be had")
        for b in hit:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.evictable.pop(b, None)
        new = [self._take() for _ in range(need)]
        req.blocks, req.block_names, req.computed = hit + new, names, len(hit) * self.block_size
        self._stats.prompt_tokens += req.prompt_len
        self._stats.hit_tokens += req.computed

    def _take(self) -> int:
        """One block for a request: a free one, else the least recently used cached one."""
        if self.free_ids:
            block = self.free_ids.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.by_name[self.name_of.pop(block)]
            self._stats.evictions += 1
        self.refs[block] = 1
        return block

    def name_full_blocks(self, req) -> None:
        """Name the blocks of ``req`` whose tokens are all computed (call after each step)."""
        if not self.prefix_caching:
            return
        p, first = self.block_size, len(req.block_names)
        ids = np.asarray(req.tokens[first * p:req.computed // p * p], dtype=np.int64)
        while len(req.block_names) < req.computed // p:
            i = len(req.block_names)
            name = self._name(req.block_names[-1] if i else self.seed, ids[(i - first) * p:(i - first + 1) * p])
            req.block_names.append(name)
            block = req.blocks[i]
            if name not in self.by_name and block not in self.name_of:  # first copy of this prefix
                self.by_name[name] = block
                self.name_of[block] = name

    def free(self, req) -> None:
        """Release ``req``'s blocks: named ones stay cached (the prompt's first blocks evicted last)."""
        for b in reversed(req.blocks):
            self.refs[b] -= 1
            if self.refs[b]:
                continue
            del self.refs[b]
            if b in self.name_of:
                self.evictable[b] = None
            else:
                self.free_ids.append(b)
        req.blocks = []
