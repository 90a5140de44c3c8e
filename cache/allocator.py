"""Block allocation for paged caches: one allocator shared by every layer of a model."""
from dsa.kernels.common import check_int


class CacheFullError(RuntimeError):
    """The pool has fewer free blocks than a request asked for; nothing was allocated."""


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1``; lowest free ids first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=0)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids, or :class:`CacheFullError` with nothing changed."""
        n = check_int("n", n, minimum=0)
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        """Return blocks to the pool; an id not allocated raises ``ValueError`` (nothing freed)."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks: {bad or blocks} are not all distinct allocated block ids")
        self._used.difference_update(blocks)
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)
