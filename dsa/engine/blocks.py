"""BlockManager: one engine's cache blocks, with automatic prefix caching.

Every layer's latent cache and indexer key cache share one block numbering, so a block id names
the same tokens in both: reusing a block reuses the latent rows and the indexer keys together.

A block whose ``P`` tokens are all computed gets a name, a chain hash
``sha256(previous block's name | P token ids)`` seeded with the engine's namespace (model shapes,
dtype, cache formats), so equal names mean equal token prefixes. A new request reuses the longest
run of named blocks that starts its tokens, except the block holding its last token, which is
always recomputed (its logits are needed, and a shared block is never written again). Blocks count
their requests; a named block whose requests finished stays cached, least recently used first
out, until the pool needs it; a block in use is never evicted.

Blocks are handed out on demand: a request gets blocks for the rows it computes in a step
(:meth:`allocate` at admission, :meth:`grow` later), and gives them all back when it finishes or
is preempted (:meth:`free`). The names of the full blocks a running request will compute are
*in flight* until computed: :meth:`in_flight_prefix` tells the scheduler that a waiting request
would compute them again, so it waits for them instead.

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
        self.in_flight: dict = {}  # name -> rid of the running request that will compute that block
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

    def chain(self, req) -> list:
        """Names of the full blocks of ``req``'s tokens before its last one (hashed once per admission)."""
        if req.chain is None:
            p, previous, names = self.block_size, self.seed, []
            full = (len(req.tokens) - 1) // p
            ids = np.asarray(req.tokens[:full * p], dtype=np.int64)  # one conversion, then a view per block
            for i in range(full):
                previous = self._name(previous, ids[i * p:(i + 1) * p])
                names.append(previous)
            req.chain = names
        return req.chain

    def _cached_prefix(self, req) -> list:
        """Blocks of the longest cached run of full blocks starting ``req``'s tokens."""
        blocks = []
        for name in self.chain(req):
            block = self.by_name.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def in_flight_prefix(self, req) -> bool:
        """Whether the first block of ``req``'s tokens that is not cached yet is being computed by a
        running request (then ``req`` had better wait for it than compute it again)."""
        if not self.prefix_caching:
            return False
        chain = self.chain(req)
        hit = len(self._cached_prefix(req))
        return hit < len(chain) and self.in_flight.get(chain[hit], req.rid) != req.rid

    def allocate(self, req) -> None:
        """Start ``req`` on its cached prefix: ``req.blocks`` (the cached blocks, held),
        ``req.block_names`` and ``req.computed`` (the reused tokens); its other full blocks become
        in flight. :meth:`grow` adds blocks for the rows it computes."""
        hit = self._cached_prefix(req) if self.prefix_caching else []
        for b in hit:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.evictable.pop(b, None)
        req.blocks, req.block_names, req.computed = hit, list(self.chain(req)[:len(hit)]), len(hit) * self.block_size
        if self.prefix_caching:
            for name in self.chain(req)[len(hit):]:
                self.in_flight.setdefault(name, req.rid)

    def count_admission(self, req) -> None:
        """Prefix-cache statistics of an admitted request (its first admission only)."""
        if not req.num_preemptions:
            self._stats.prompt_tokens += req.prompt_len
            self._stats.hit_tokens += req.computed

    def grow(self, req, num_tokens: int) -> None:
        """Blocks for ``req``'s first ``num_tokens`` tokens; :class:`CacheFullError` (nothing changed)
        when the pool has too few free ones."""
        need = cdiv(num_tokens, self.block_size) - len(req.blocks)
        if need > self.num_free:
            raise CacheFullError(f"asked for {need} blocks, {self.num_free} of {self.num_blocks} can be had")
        req.blocks += [self._take() for _ in range(need)]

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
        p, chain = self.block_size, self.chain(req)
        first = len(req.block_names)
        ids = None
        while len(req.block_names) < req.computed // p:
            i = len(req.block_names)
            if i < len(chain):
                name = chain[i]
            else:  # a block of generated tokens
                if ids is None:
                    ids = np.asarray(req.tokens[first * p:req.computed // p * p], dtype=np.int64)
                name = self._name(req.block_names[-1] if i else self.seed, ids[(i - first) * p:(i - first + 1) * p])
            req.block_names.append(name)
            if self.in_flight.get(name) == req.rid:
                del self.in_flight[name]
            block = req.blocks[i]
            if name not in self.by_name and block not in self.name_of:  # first copy of this prefix
                self.by_name[name] = block
                self.name_of[block] = name

    def free(self, req) -> None:
        """Release ``req``'s blocks: named ones stay cached (the prompt's first blocks evicted last)."""
        for name in (req.chain or ())[len(req.block_names):]:
            if self.in_flight.get(name) == req.rid:
                del self.in_flight[name]
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
