"""The block manager: allocation, refusal without change, release, eviction of cached blocks."""
import pytest

from dsa.engine.blocks import BlockManager, CacheFullError
from dsa.engine.scheduler import Request


def _req(rid, tokens):
    return Request(rid, list(tokens), len(tokens), 1)


def test_allocate_refuse_and_free_without_leaks():
    m = BlockManager(5, 4, prefix_caching=False)
    a = _req(0, range(10))
    m.allocate(a, 12)
    assert a.blocks == [0, 1, 2] and m.num_free == 2 and m.num_used == 3
    b = _req(1, range(10))
    with pytest.raises(CacheFullError):
        m.allocate(b, 12)
    assert m.num_free == 2 and b.blocks == []  # nothing changed
    m.free(a)
    assert a.blocks == [] and m.num_free == 5 and m.num_used == 0
    m.allocate(b, 20)
    assert sorted(b.blocks) == [0, 1, 2, 3, 4] and m.num_free == 0


def test_named_blocks_stay_cached_and_are_evicted_last_used_first():
    m = BlockManager(4, 2)
    a = _req(0, [1, 2, 3, 4, 5])
    m.allocate(a, 6)
    a.computed = 5
    m.name_full_blocks(a)
    full = a.blocks[:2]
    m.free(a)
    assert m.stats.cached_blocks == 2 and m.num_free == 4 and m.num_used == 0
    b = _req(1, [1, 2, 3, 4, 9])  # shares both full blocks
    m.allocate(b, 6)
    assert b.computed == 4 and b.blocks[:2] == full
    m.free(b)
    c = _req(2, [7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts the cached ones
    m.allocate(c, 8)
    assert m.stats.evictions == 2 and m.stats.cached_blocks == 0 and m.num_free == 0

