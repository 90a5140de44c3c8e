"""Resident memory of the engine alone over many requests (CPU, the ``tiny`` preset): does it leak?

120 batches of 32 requests (prompts 4-200 tokens, 1-16 new, greedy and sampled), each batch run to
the end; every 20 batches the resident memory before and after ``malloc_trim(0)`` (glibc gives
freed heap back to the OS). Flat after the trim: nothing is kept per request.

    python benchmarks/engine_memory.py > benchmarks/results/engine-memory-cpu-2cores-2026-12-01.log
"""
import ctypes
import gc
import os
import random

import torch

from dsa import DSAModel, Engine, SamplingParams
from dsa.model.presets import PRESETS


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    model = DSAModel.random(PRESETS["tiny"](), seed=0, dtype=torch.float32, device="cpu")
    engine = Engine(model, num_blocks=400, max_batch_tokens=512)
    rng = random.Random(0)
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    for batch in range(120):
        for _ in range(32):
            prompt = [rng.randrange(200) for _ in range(rng.randint(4, 200))]
            engine.add_request(prompt, sampling=SamplingParams(max_tokens=rng.randint(1, 16),
                                                               temperature=rng.choice([0.0, 0.8])))
        while engine.has_work():
            engine.step()
        if batch % 20 == 19:
            gc.collect()
            before = resident_mib()
            trim(0)
            print(f"{32 * (batch + 1)} requests: resident {before:.0f} MiB, after malloc_trim {resident_mib():.0f} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
