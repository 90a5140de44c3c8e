"""The block manager: blocks on demand, refusal without change, release, cached blocks evicted
least recently used first, in-flight prefix names. The manager returns what it hands out and
never writes a request (the scheduler does: here the test, as the scheduler would)."""
import gc
import random
from collections import OrderedDict

import pytest

from dsa.engine.blocks import BlockManager, CacheFullError, EvictionOrder
from dsa.engine.scheduler import Request


def _req(m, rid, tokens):
    r = Request(rid, list(tokens), len(tokens), 1)
    r.chain = m.chain(r.tokens)
    return r


def _start(m, r):
    """Admit ``r`` on its cached prefix, as the scheduler does."""
    r.blocks = m.allocate(r)
    r.block_names, r.computed = r.chain[:len(r.blocks)], len(r.blocks) * m.block_size


def test_grow_refuse_and_free_without_leaks():
    m = BlockManager(5, 4, prefix_caching=False)
    a = _req(m, 0, range(10))
    _start(m, a)
    assert a.blocks == [] and a.computed == 0 and a.chain == []
    a.blocks += m.grow(a, 12)
    assert a.blocks == [0, 1, 2] and m.num_free == 2 and m.num_used == 3
    assert m.grow(a, 11) == []  # it has the blocks already
    b = _req(m, 1, range(10))
    _start(m, b)
    with pytest.raises(CacheFullError):
        m.grow(b, 12)
    assert m.num_free == 2 and m.num_used == 3  # nothing changed
    m.free(a)
    assert m.num_free == 5 and m.num_used == 0
    assert sorted(m.grow(b, 20)) == [0, 1, 2, 3, 4] and m.num_free == 0


def test_named_blocks_stay_cached_and_are_evicted_last_used_first():
    m = BlockManager(4, 2)
    a = _req(m, 0, [1, 2, 3, 4, 5])
    _start(m, a)
    a.blocks += m.grow(a, 6)
    a.computed = 5
    names = m.name_full_blocks(a)
    assert names == a.chain and m.name_full_blocks(a) == names  # named once: the same names again
    a.block_names += names
    assert m.name_full_blocks(a) == []
    full = a.blocks[:2]
    m.free(a)
    assert m.stats.cached_blocks == 2 and m.num_free == 4 and m.num_used == 0
    b = _req(m, 1, [1, 2, 3, 4, 9])  # shares both full blocks
    _start(m, b)
    assert b.computed == 4 and b.blocks == full
    m.free(b)
    c = _req(m, 2, [7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts the cached ones
    _start(m, c)
    c.blocks += m.grow(c, 8)
    assert m.stats.evictions == 2 and m.stats.cached_blocks == 0 and m.num_free == 0


def test_generated_tokens_name_blocks_past_the_prompts_chain():
    m = BlockManager(8, 2)
    a = _req(m, 0, [1, 2, 3])  # chain: one block (its last token is not in it)
    _start(m, a)
    a.blocks += m.grow(a, 6)
    a.tokens += [4, 5, 6]
    a.computed = 6
    a.block_names += m.name_full_blocks(a)
    whole = m.chain([1, 2, 3, 4, 5, 6, 0])  # the names the same tokens get as a prompt
    assert a.block_names == whole and len(whole) == 3, (a.block_names, whole)


def test_in_flight_blocks_make_a_sharing_request_wait_until_computed():
    m = BlockManager(8, 2)
    doc = [5, 6, 7, 8, 9, 10]
    a, b = _req(m, 0, doc + [1]), _req(m, 1, doc + [2])
    _start(m, a)
    a.blocks += m.grow(a, 7)
    assert m.in_flight_prefix(b) and not m.in_flight_prefix(a)  # a computes the 3 document blocks
    a.computed = 4
    a.block_names += m.name_full_blocks(a)
    assert m.in_flight_prefix(b)  # its third block is still being computed
    a.computed = 7
    a.block_names += m.name_full_blocks(a)
    assert not m.in_flight_prefix(b)
    _start(m, b)
    assert b.computed == 6 and b.blocks == a.blocks[:3]


def test_a_freed_request_leaves_no_in_flight_names():
    m = BlockManager(8, 2)
    a, b = _req(m, 0, [1, 2, 3, 4, 5]), _req(m, 1, [1, 2, 3, 4, 6])
    _start(m, a)
    assert m.in_flight_prefix(b)
    m.free(a)
    assert not m.in_flight_prefix(b) and not m.in_flight


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_eviction_order_matches_an_ordered_dict(seed):
    rng, n = random.Random(seed), 37
    order, model = EvictionOrder(n), OrderedDict()
    for _ in range(3000):
        b = rng.randrange(n)
        op = rng.random()
        if op < 0.45 and b not in model:
            order.append(b)
            model[b] = None
        elif op < 0.8:
            order.discard(b)
            model.pop(b, None)
        elif model:
            assert order.pop_oldest() == model.popitem(last=False)[0]
        assert len(order) == len(model) and (b in order) == (b in model)
    assert list(order) == list(model)


def test_a_full_pool_gives_the_garbage_collector_nothing_to_walk():
    """Collection time grows with what tracked containers hold: the pool's structures hold nothing
    the collector walks, however many blocks are cached (an OrderedDict of 4096 blocks would be 8192
    referents, the free list 4096)."""
    m = BlockManager(4096, 2)
    for rid in range(4095):  # unique 3-token prompts: one named block each (and one unnamed), then freed
        r = _req(m, rid, [rid, rid + 1, 7])
        _start(m, r)
        r.blocks += m.grow(r, 3)
        r.computed = 3
        r.block_names += m.name_full_blocks(r)
        m.free(r)
    assert m.stats.cached_blocks == 4095 and len(m.evictable) == 4095 and len(m.free_ids) == 1
    walked = {k: len(gc.get_referents(v)) for k, v in vars(m).items() if gc.is_tracked(v)}
    assert sum(walked.values()) < 16, f"the collector walks {walked} referents of the block manager"
