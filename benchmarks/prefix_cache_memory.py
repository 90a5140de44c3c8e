"""Host memory of the prefix cache's bookkeeping per cached block (names, block maps, LRU order),
traced by tracemalloc over 1,000 requests shaped like the H200 soak's (prompts of 16-4,096 random
byte tokens, block size 64, a pool too large to evict: demo-gpu's on an H200 holds ~350K blocks).

    python benchmarks/prefix_cache_memory.py
"""
import gc
import random
import tracemalloc

from dsa.engine.scheduler import Request, Scheduler


def main():
    random.seed(0)
    s = Scheduler(num_blocks=360_000, block_size=64, max_batch_tokens=1 << 30)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(1000):
        n = random.randint(16, 4096)
        req = Request(i, [random.randrange(256) for _ in range(n)], n, 64)
        s.add(req)
        out = s.schedule()
        for r, rows in zip(out.requests, out.num_rows):
            s.advance(r, rows)
            s.name_blocks(r)
        s.finish(req)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    cached = len(s.blocks.name_of)
    print(f"1000 requests: {cached} cached blocks, {used / 2**20:.1f} MiB traced, {used / cached:.0f} B per cached block")


if __name__ == "__main__":
    main()
