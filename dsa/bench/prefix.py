"""``dsa bench prefix``: time to first token of questions about one long document, with and without
prefix caching, on the demo model (4 V3.2-shaped layers).

A 32K-token document is followed by 8 different 64-token questions, asked one after another; each
request's time to first token is the wall time from ``add_request`` to its first sampled token on
the host. An untimed request on another document of the same length first compiles every kernel.
"""
import dataclasses
import time

import torch

from dsa.config import DSAConfig
from dsa.engine import Engine
from dsa.kernels.common import cdiv
from dsa.model import DSAModel
from dsa.model.presets import GPU_DEFAULT

from .harness import result_row

DOC, QUESTION, QUESTIONS = 32768, 64, 8


def ttft(engine: Engine, ids: list) -> float:
    """Seconds from queuing ``ids`` to its first token."""
    t0 = time.perf_counter()
    rid = engine.add_request(ids, 1)
    while rid not in engine.step():
        pass
    return time.perf_counter() - t0


def run(device, timer, ceilings, args) -> list:
    model = DSAModel.random(DSAConfig.deepseek_v32(**GPU_DEFAULT), seed=0, dtype=torch.bfloat16, device=device)
    vocab, p = model.config.vocab_size, model.config.block_size
    g = torch.Generator().manual_seed(0)
    other, doc = (torch.randint(0, vocab, (DOC,), generator=g).tolist() for _ in range(2))
    questions = [torch.randint(0, vocab, (QUESTION,), generator=g).tolist() for _ in range(QUESTIONS)]
    rows = []
    for caching in (True, False):
        engine = Engine(model, num_blocks=2 * cdiv(DOC + QUESTION + 1, p) + 8, prefix_caching=caching)
        ttft(engine, other + questions[0])  # compiles the kernels; its blocks never match the document
        before = dataclasses.asdict(engine.stats.prefix)
        times = [ttft(engine, doc + q) for q in questions]
        stats = {k: v - before[k] for k, v in dataclasses.asdict(engine.stats.prefix).items()}
        name = "cached" if caching else "uncached"
        for i, t in enumerate(times):
            ratio = t / times[0]
            rows.append(result_row("prefix_ttft", name, dict(doc=DOC, question=QUESTION, index=i),
                                   dict(median_us=t * 1e6, reps=1), ceilings, ratio_to_first=ratio,
                                   target_ratio_to_first=0.05 if caching and i > 0 else None))
        rows[-1]["hit_rate"] = stats["hit_tokens"] / max(1, stats["prompt_tokens"])
        print(f"{name}: first {times[0] * 1e3:.1f} ms, then " + ", ".join(f"{t * 1e3:.1f}" for t in times[1:])
              + f" ms; prefix hit rate {rows[-1]['hit_rate']:.3f}", flush=True)
        del engine
        torch.cuda.empty_cache()
    return rows
