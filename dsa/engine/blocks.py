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

The manager reads a request's fields and never writes them: each method returns what changed
(the blocks taken, the names given), and the scheduler, the one writer of a request, stores it.

Free blocks are a stack (allocate and free are O(1) per block; a fresh pool hands out the lowest
ids first). The structures that grow with the pool hold no Python object per entry the garbage
collector walks: the free stack and the eviction order are int arrays, the maps hold only ints and
bytes (dicts of those are untracked), so a full collection costs the same at 344K cached blocks as
at 300 (a ``list`` of 344K ints costs ~3 ms a collection, an ``OrderedDict`` of them ~11 ms).
"""
import hashlib
from array import array
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


class EvictionOrder:
    """Blocks least recently released first: a doubly linked list in two int arrays over ``num_blocks``
    ids (the extra slot ``num_blocks`` is the list's head and tail), O(1) to append, remove or pop the
    oldest, ``2 * 8 + 1`` bytes per block, allocated once."""

    def __init__(self, num_blocks: int):
        self._end = num_blocks
        self._prev = array("q", [num_blocks]) * (num_blocks + 1)
        self._next = array("q", [num_blocks]) * (num_blocks + 1)
        self._member = bytearray(num_blocks)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return bool(self._member[block])

    def __iter__(self):
        b = self._next[self._end]
        while b != self._end:
            yield b
            b = self._next[b]

    def append(self, block: int) -> None:
        """``block`` as the most recently released (it must not be in the order)."""
        last = self._prev[self._end]
        self._next[last], self._prev[block], self._next[block], self._prev[self._end] = block, last, self._end, block
        self._member[block] = 1
        self._len += 1

    def discard(self, block: int) -> None:
        """``block`` out of the order, if it is in it."""
        if self._member[block]:
            before, after = self._prev[block], self._next[block]
            self._next[before], self._prev[after] = after, before
            self._member[block] = 0
            self._len -= 1

    def pop_oldest(self) -> int:
        """The least recently released block, taken out (the order must not be empty)."""
        block = self._next[self._end]
        self.discard(block)
        return block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str = "", prefix_caching: bool = True):
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_ids = array("q", range(num_blocks - 1, -1, -1))  # a stack of never-used or freed unnamed blocks
        self.seed = hashlib.sha256(namespace.encode()).digest()
        self.refs: dict = {}  # block -> requests holding it
        self.by_name: dict = {}  # name -> block
        self.name_of: dict = {}  # block -> name
        self.evictable = EvictionOrder(num_blocks)  # named blocks no request holds, least recently used first
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

    def chain(self, tokens: list) -> list:
        """Names of the full blocks of ``tokens`` before the last one (a request hashes its tokens
        once per admission: the scheduler keeps them as ``req.chain``); none without prefix caching."""
        if not self.prefix_caching:
            return []
        p, previous, names = self.block_size, self.seed, []
        full = (len(tokens) - 1) // p
        ids = np.asarray(tokens[:full * p], dtype=np.int64)  # one conversion, then a view per block
        for i in range(full):
            previous = self._name(previous, ids[i * p:(i + 1) * p])
            names.append(previous)
        return names

    def _cached_prefix(self, req) -> list:
        """Blocks of the longest cached run of full blocks starting ``req``'s tokens."""
        blocks = []
        for name in req.chain:
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
        hit = len(self._cached_prefix(req))
        return hit < len(req.chain) and self.in_flight.get(req.chain[hit], req.rid) != req.rid

    def allocate(self, req) -> list:
        """Start ``req`` (no blocks yet) on its cached prefix: returns the cached blocks, now held
        (they cover ``len * block_size`` of its tokens, named ``req.chain[:len]``); its other full
        blocks become in flight. :meth:`grow` gives blocks for the rows it computes."""
        hit = self._cached_prefix(req) if self.prefix_caching else []
        for b in hit:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.evictable.discard(b)
        if self.prefix_caching:
            for name in req.chain[len(hit):]:
                self.in_flight.setdefault(name, req.rid)
        return hit

    def count_admission(self, req) -> None:
        """Prefix-cache statistics of an admitted request (its first admission only)."""
        if not req.num_preemptions:
            self._stats.prompt_tokens += req.prompt_len
            self._stats.hit_tokens += req.computed

    def grow(self, req, num_tokens: int) -> list:
        """The blocks ``req`` needs beyond ``req.blocks`` for its first ``num_tokens`` tokens, now
        held; :class:`CacheFullError` (nothing changed) when the pool has too few free ones."""
        need = cdiv(num_tokens, self.block_size) - len(req.blocks)
        if need > self.num_free:
            raise CacheFullError(f"asked for {need} blocks, {self.num_free} of {self.num_blocks} can be had")
        return [self._take() for _ in range(need)]

    def _take(self) -> int:
        """One block for a request: a free one, else the least recently used cached one."""
        if self.free_ids:
            block = self.free_ids.pop()
        else:
            block = self.evictable.pop_oldest()
            del self.by_name[self.name_of.pop(block)]
            self._stats.evictions += 1
        self.refs[block] = 1
        return block

    def name_full_blocks(self, req) -> list:
        """Names for ``req``'s blocks whose tokens are all computed and that have none yet (the
        ones after ``req.block_names``), in order; the first block of each prefix becomes cached."""
        if not self.prefix_caching:
            return []
        p, chain, done = self.block_size, req.chain, len(req.block_names)
        ids, names = None, []
        for i in range(done, req.computed // p):
            if i < len(chain):
                name = chain[i]
            else:  # a block of generated tokens
                if ids is None:
                    ids = np.asarray(req.tokens[done * p:req.computed // p * p], dtype=np.int64)
                previous = names[-1] if names else req.block_names[-1] if i else self.seed
                name = self._name(previous, ids[(i - done) * p:(i - done + 1) * p])
            names.append(name)
            if self.in_flight.get(name) == req.rid:
                del self.in_flight[name]
            block = req.blocks[i]
            if name not in self.by_name and block not in self.name_of:  # first copy of this prefix
                self.by_name[name] = block
                self.name_of[block] = name
        return names

    def free(self, req) -> None:
        """Release ``req``'s blocks (its names in flight too): named ones stay cached (the prompt's
        first blocks evicted last)."""
        for name in (req.chain or ())[len(req.block_names):]:
            if self.in_flight.get(name) == req.rid:
                del self.in_flight[name]
        for b in reversed(req.blocks):
            self.refs[b] -= 1
            if self.refs[b]:
                continue
            del self.refs[b]
            if b in self.name_of:
                self.evictable.append(b)
            else:
                self.free_ids.append(b)
