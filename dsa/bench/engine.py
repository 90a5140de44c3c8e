"""``dsa bench engine``: the Engine's decode throughput on the demo model (4 V3.2-shaped layers).

For B requests at context S, the caches are filled with random bytes of the right formats (no real
prefill) and the requests are placed as if their prompts had just been prefilled; then decode steps
are timed one by one, each ending with its sampled ids on the host. ``step_us`` is the wall time of
``engine.step()`` (plan, upload, graph replay, sampling, bookkeeping), ``replay_us`` the device time
of the step's CUDA graph alone (replayed with the L2 flushed), ``host_share`` =
``(step_us - replay_us) / step_us``. DSA runs the demo model; dense runs the same weights without
the indexer (the dense absorbed decode over the whole context).
"""
import time

import torch

from dsa.config import DSAConfig
from dsa.engine import Engine
from dsa.engine.runner import batch_bucket, context_bucket
from dsa.engine.sampling import SamplingParams
from dsa.kernels.common import cdiv
from dsa.model import DSAModel
from dsa.model.presets import GPU_DEFAULT

from .harness import result_row
from .indexer import random_index_cache

WARMUP, STEPS = 3, 20
CHUNK_BLOCKS = 4096  # blocks filled per random draw


def demo_models(device) -> dict:
    """The demo's GPU model (seed 0) and the same weights without an indexer."""
    cfg = DSAConfig.deepseek_v32(**GPU_DEFAULT)
    dsa_model = DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device=device)
    with torch.device(device):
        dense = DSAModel(cfg.replace(index_topk=None))
    missing, _ = dense.load_state_dict(dsa_model.state_dict(), strict=False)
    assert not missing, missing
    return {"dsa": dsa_model, "dense": dense.finalize(torch.bfloat16, device)}


def fill_caches(engine: Engine, g: torch.Generator) -> None:
    for latent, index in engine.caches:
        nb = latent.data.shape[0]
        for b0 in range(0, nb, CHUNK_BLOCKS):
            b1 = min(nb, b0 + CHUNK_BLOCKS)
            latent.data[b0:b1] = torch.randn(latent.data[b0:b1].shape, generator=g, device=latent.data.device,
                                             dtype=torch.bfloat16) * 0.5
            if index is not None:
                index.data[b0:b1] = random_index_cache(b1 - b0, index.data.device, g)


def decoding_engine(model, b: int, s: int, g: torch.Generator) -> Engine:
    """An engine whose B requests sit at context S with their first token sampled."""
    p = model.config.block_size
    steps = WARMUP + STEPS + 2
    engine = Engine(model, num_blocks=b * cdiv(s + steps, p), cuda_graphs=True, prefix_caching=False)
    fill_caches(engine, g)
    for i in range(b):
        tokens = torch.randint(0, model.config.vocab_size, (s,), generator=torch.Generator().manual_seed(i))
        engine.add_request(tokens.tolist(), sampling=SamplingParams(max_tokens=steps, ignore_eos=True))  # greedy
    engine.scheduler.schedule()  # admits every request: their blocks
    for req in engine.scheduler.running.values():  # as if prefilled: the random cache rows stand for the prompt
        req.computed = s
        req.tokens.append(0)  # its first token
    return engine


def run(device, timer, ceilings, args) -> list:
    models = demo_models(device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    shapes = [(1, 32768), (64, 8192)] if args.quick else [(b, s) for b in (1, 8, 64) for s in (8192, 32768, 131072)]
    for b, s in shapes:
        per = {}
        for name, model in models.items():
            engine = decoding_engine(model, b, s, g)
            walls = []
            for i in range(WARMUP + STEPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = engine.step()  # ends with the sampled ids on the host
                walls.append((time.perf_counter() - t0) * 1e6)
                assert len(out) == b
            assert engine.stats.graph_steps == WARMUP + STEPS
            walls = sorted(walls[WARMUP:])
            step_us = walls[len(walls) // 2]
            graph = engine.runner.graphs[(batch_bucket(b), context_bucket(s + WARMUP + STEPS, model.config.block_size))]
            replay = timer(graph.graph.replay)
            per[name] = step_us
            rows.append(result_row("engine_decode", f"{name}+graph", dict(B=b, S=s, layers=model.config.num_hidden_layers),
                                   dict(median_us=step_us, p10_us=walls[len(walls) // 10], p90_us=walls[9 * len(walls) // 10],
                                        reps=STEPS), ceilings, tokens_per_s=b / step_us * 1e6,
                                   replay_us=replay["median_us"], host_share=max(0.0, 1 - replay["median_us"] / step_us),
                                   target_tokens_per_s=500.0 if (name, b, s) == ("dsa", 1, 32768) else None,
                                   target_host_share=0.10 if name == "dsa" and s == 8192 and b in (1, 64) else None))
            r = rows[-1]
            print(f"{name} B={b} S={s}: {step_us:.0f} us/step = {r['tokens_per_s']:.0f} tokens/s, graph replay "
                  f"{r['replay_us']:.0f} us, host share {100 * r['host_share']:.1f}%", flush=True)
            del engine
            torch.cuda.empty_cache()
        rows[-2]["speedup_vs_dense"] = per["dense"] / per["dsa"]
    return rows
