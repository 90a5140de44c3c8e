"""Host memory of the serving path's bookkeeping, traced by tracemalloc on CPU:

- the prefix cache's per cached block (names, block maps, LRU order), over ``--requests`` (default
  1,000) requests shaped like the H200 soak's (prompts of 16-4,096 random byte tokens, block size 64, a
  pool too large to evict: demo-gpu's on an H200 holds ~340K blocks, which ~16,000 such requests fill);
  the dicts' tables grow in steps, so the figure per block depends on where the count falls;
- the engine loop's per-step record behind ``dsa_generation_tokens_per_second`` (what a server kept
  per step when nobody read ``/metrics``, before the loop trimmed its window itself).

    python benchmarks/host_bookkeeping_memory.py [--requests 16000]
"""
import argparse
import collections
import gc
import random
import time
import tracemalloc

from dsa.engine.scheduler import Request, Scheduler


def prefix_cache(requests: int) -> str:
    random.seed(0)
    s = Scheduler(num_blocks=360_000, block_size=64, max_batch_tokens=1 << 30)
    base = tracemalloc.get_traced_memory()[0]
    for i in range(requests):
        n = random.randint(16, 4096)
        req = Request(i, [random.randrange(256) for _ in range(n)], n, 64)
        s.add(req)
        out = s.schedule()  # the whole prompt in one step; its last row samples
        s.update([(row, 0, True) for row in out.sampled])  # which ends it: its named blocks stay cached
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    cached = len(s.blocks.name_of)
    return (f"{requests} requests: {cached} cached blocks, {used / 2**20:.1f} MiB traced, "
            f"{used / cached:.0f} B per cached block")


def rate_window(steps: int = 100_000) -> str:
    records = collections.deque()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(steps):  # as EngineLoop: (monotonic time, tokens the step generated)
        records.append((time.monotonic(), i % 64))
    used = tracemalloc.get_traced_memory()[0] - base
    return f"rate window: {steps} step records, {used / steps:.0f} B per record"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests the prefix cache takes (default 1000)")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error(f"--requests: expected a positive count, got {args.requests}")
    tracemalloc.start()
    print(prefix_cache(args.requests))
    print(rate_window())


if __name__ == "__main__":
    main()
