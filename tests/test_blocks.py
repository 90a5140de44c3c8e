"""The block manager: blocks on demand, refusal without change, release, cached blocks evicted
least recently used first, in-flight prefix names."""
import pytest

from dsa.engine.blocks import BlockManager, CacheFullError
from dsa.engine.scheduler import Request


def _req(rid, tokens):
    return Request(rid, list(tokens), len(tokens), 1)


def test_grow_refuse_and_free_without_leaks():
    m = BlockManager(5, 4, prefix_caching=False)
    a = _req(0, range(10))
    m.allocate(a)
    assert a.blocks == [] and a.computed == 0
    m.grow(a, 12)
    assert a.blocks == [0, 1, 2] and m.num_free == 2 and m.num_used == 3
    b = _req(1, range(10))
    m.allocate(b)
    with pytest.raises(CacheFullError):
        m.grow(b, 12)
    assert m.num_free == 2 and b.blocks == []  # nothing changed
    m.free(a)
    assert a.blocks == [] and m.num_free == 5 and m.num_used == 0
    m.grow(b, 20)
    assert sorted(b.blocks) == [0, 1, 2, 3, 4] and m.num_free == 0


def test_named_blocks_stay_cached_and_are_evicted_last_used_first():
    m = BlockManager(4, 2)
    a = _req(0, [1, 2, 3, 4, 5])
    m.allocate(a)
    m.grow(a, 6)
    a.computed = 5
    m.name_full_blocks(a)
    full = a.blocks[:2]
    m.free(a)
    assert m.stats.cached_blocks == 2 and m.num_free == 4 and m.num_used == 0
    b = _req(1, [1, 2, 3, 4, 9])  # shares both full blocks
    m.allocate(b)
    assert b.computed == 4 and b.blocks == full
    m.free(b)
    c = _req(2, [7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts the cached ones
    m.allocate(c)
    m.grow(c, 8)
    assert m.stats.evictions == 2 and m.stats.cached_blocks == 0 and m.num_free == 0


def test_in_flight_blocks_make_a_sharing_request_wait_until_computed():
    m = BlockManager(8, 2)
    doc = [5, 6, 7, 8, 9, 10]
    a, b = _req(0, doc + [1]), _req(1, doc + [2])
    m.allocate(a)
    m.grow(a, 7)
    assert m.in_flight_prefix(b) and not m.in_flight_prefix(a)  # a computes the 3 document blocks
    a.computed = 4
    m.name_full_blocks(a)
    assert m.in_flight_prefix(b)  # its third block is still being computed
    a.computed = 7
    m.name_full_blocks(a)
    assert not m.in_flight_prefix(b)
    m.allocate(b)
    assert b.computed == 6 and b.blocks == a.blocks[:3]


def test_a_freed_request_leaves_no_in_flight_names():
    m = BlockManager(8, 2)
    a, b = _req(0, [1, 2, 3, 4, 5]), _req(1, [1, 2, 3, 4, 6])
    m.allocate(a)
    assert m.in_flight_prefix(b)
    m.free(a)
    assert not m.in_flight_prefix(b) and not m.in_flight
