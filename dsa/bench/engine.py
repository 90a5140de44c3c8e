"""``dsa bench engine``: the Engine's decode throughput on the demo model (4 V3.2-shaped layers).

For B requests at context S, the caches are filled with random bytes of the right formats (no real
prefill) and the requests are placed as if their prompts had just been prefilled; then STEPS
consecutive decode steps are timed together (steady state: the host schedules and packs step N+1
while the GPU runs step N). ``mean_us`` is their wall time per step (plan, upload, graph replay,
sampling, bookkeeping: the STEPS steps' time to the last synchronize over STEPS); ``median_us``,
``p10_us`` and ``p90_us`` are the median and percentiles of the gaps between step returns;
``replay_us`` is the device time of the step's CUDA graph alone (replayed with the L2 flushed).
Throughput comes from the mean: ``tokens_per_s`` = ``B / mean_us``, ``host_share`` =
``(mean_us - replay_us) / mean_us``, ``speedup_vs_dense`` the ratio of the means. DSA runs the demo model; dense runs the same weights without
the indexer (the dense absorbed decode over the whole context).

``engine_prefill`` rows: one 32K-token prompt prefilled in chunks of 8192 rows (eager, no graphs),
its first token sampled; ``tokens_per_s`` = prompt tokens / wall time, median of 3 after a warm-up.

Tensor parallelism (``torchrun --nproc-per-node N -m dsa bench engine --tp N``; rank 0 writes
``engine-tpN-<gpu>-<date>.json``): every row carries ``tp_size`` and the all-reduce ``allreduce``
path (:mod:`dsa.model.allreduce`). With ``tp_size > 1`` each decode row also has
``replay_no_allreduce_us``: the same step captured again inside
:func:`dsa.model.parallel.without_all_reduce` (every all-reduce a no-op, so its outputs are partial
sums: wrong; timing only) and replayed; ``allreduce_share`` = ``1 - replay_no_allreduce_us /
replay_us``. Prefill rows have ``no_allreduce_us`` the same way. A TP=1 run is a separate
single-process invocation; ``dsa bench render --tp-compare`` puts the two files side by side.

``--speculative-tokens N``: speculative decoding's rows instead (:mod:`dsa.bench.speculative`).
"""
import time

import numpy as np
import torch

from dsa.config import DSAConfig
from dsa.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.kernels.common import cdiv
from dsa.model import DSAModel
from dsa.model.parallel import without_all_reduce
from dsa.model.presets import GPU_DEFAULT
from dsa.model.route import graph_bucket

from .harness import result_row
from .indexer import random_index_cache

WARMUP, STEPS = 3, 20
CHUNK_BLOCKS = 4096  # blocks filled per random draw
PREFILL_TOKENS, PREFILL_CHUNK, PREFILL_REPS = 32768, 8192, 3
NO_ALLREDUCE = ("*_no_allreduce_us: the same work with every all-reduce a no-op (wrong outputs, each rank's "
                "partial sums); timing only")


def demo_models(device, tp_size: int = 1) -> dict:
    """The demo's GPU model (seed 0) and the same weights without an indexer (both this rank's shard
    under tensor parallelism)."""
    cfg = DSAConfig.deepseek_v32(**GPU_DEFAULT)
    dsa_model = DSAModel.random(cfg, seed=0, dtype=torch.bfloat16, device=device, tp_size=tp_size)
    return {"dsa": dsa_model, "dense": without_indexer(dsa_model)}


def without_indexer(model: DSAModel) -> DSAModel:
    """The same weights (this rank's shard) without the indexer: dense attention over every position."""
    with torch.device(model.device):
        dense = DSAModel(model.config.replace(index_topk=None), tp=model.tp)
    missing, _ = dense.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    return dense.finalize(model.dtype, model.device)


def fill_caches(engine: Engine, g: torch.Generator) -> None:
    for latent, index in engine.caches:
        nb = latent.data.shape[0]
        for b0 in range(0, nb, CHUNK_BLOCKS):
            b1 = min(nb, b0 + CHUNK_BLOCKS)
            latent.data[b0:b1] = torch.randn(latent.data[b0:b1].shape, generator=g, device=latent.data.device,
                                             dtype=torch.bfloat16) * 0.5
            if index is not None:
                index.data[b0:b1] = random_index_cache(b1 - b0, index.data.device, g)


def decoding_engine(model, b: int, s: int, g: torch.Generator, cuda_graphs: bool | None = True) -> Engine:
    """An engine whose B requests sit at context S with their first token sampled."""
    p = model.config.block_size
    steps = WARMUP + STEPS + 3  # + the step that captures the graph without all-reduce
    engine = Engine(model, num_blocks=b * cdiv(s + steps, p), cuda_graphs=cuda_graphs, prefix_caching=False)
    fill_caches(engine, g)
    for i in range(b):
        tokens = torch.randint(0, model.config.vocab_size, (s,), generator=torch.Generator().manual_seed(i))
        engine.add_request(tokens.tolist() + [0],  # 0: its first token; greedy
                           sampling=SamplingParams(max_tokens=steps - 1, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting:  # as if prefilled: the random cache rows stand for the prompt
        sched.run_as_prefilled(sched.waiting[0])
    return engine


def step_timing(t0: float, returned: list, end: float) -> dict:
    """Consecutive steps started at ``t0`` (seconds), step i returning at ``returned[i]``, the device
    synchronized at ``end``: ``mean_us`` = ``(end - t0) / steps``; ``median_us``, ``p10_us``, ``p90_us``
    of the gaps between returns (the upper median at an even count, as :class:`~dsa.bench.harness.Timer`)."""
    gaps = sorted(1e6 * (t1 - t) for t, t1 in zip([t0] + returned[:-1], returned))
    n = len(gaps)
    return {"median_us": gaps[n // 2], "mean_us": 1e6 * (end - t0) / n, "p10_us": gaps[n // 10],
            "p90_us": gaps[9 * n // 10], "reps": n}


def prefill_row(name: str, model, ceilings, tp_extra: dict, say) -> dict:
    """Wall time of one PREFILL_TOKENS prompt, chunks of PREFILL_CHUNK rows, to its first token."""
    p = model.config.block_size
    engine = Engine(model, num_blocks=cdiv(PREFILL_TOKENS + 1, p) + 1, max_batch_tokens=PREFILL_CHUNK,
                    prefix_caching=False)
    prompt = torch.randint(0, model.config.vocab_size, (PREFILL_TOKENS,), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)

    def walls(reps: int) -> list:
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate([prompt.tolist()], sampling=sampling)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) * 1e6)
        return sorted(out)

    walls(1)  # Triton compiles per shape on first use
    w = walls(PREFILL_REPS)
    extra = {}
    if model.tp.size > 1:
        with without_all_reduce():
            extra = dict(no_allreduce_us=walls(PREFILL_REPS)[PREFILL_REPS // 2], note=NO_ALLREDUCE)
    row = result_row("engine_prefill", name, dict(S=PREFILL_TOKENS, chunk=PREFILL_CHUNK,
                                                  layers=model.config.num_hidden_layers),
                     dict(median_us=w[len(w) // 2], p10_us=w[0], p90_us=w[-1], reps=PREFILL_REPS), ceilings,
                     tokens_per_s=PREFILL_TOKENS / w[len(w) // 2] * 1e6, **tp_extra, **extra)
    say(f"{name} prefill {PREFILL_TOKENS} tokens: {row['median_us'] / 1e3:.1f} ms = {row['tokens_per_s']:.0f} tokens/s"
        + (f", without all-reduce {extra['no_allreduce_us'] / 1e3:.1f} ms" if extra else ""))
    del engine
    torch.cuda.empty_cache()
    return row


def last_step_bucket(b: int, s: int, block_size: int):
    """The graph key of the timed window's last step: ``b`` requests decoding one token each, the
    longest at ``s + WARMUP + STEPS`` tokens (the runner's :func:`~dsa.model.route.graph_bucket`)."""
    return graph_bucket(np.ones(b, np.int32), s + WARMUP + STEPS, block_size)


def run(device, timer, ceilings, args) -> list:
    if getattr(args, "speculative_tokens", 0):
        from .speculative import run as speculative_rows
        return speculative_rows(device, timer, ceilings, args)
    models = demo_models(device, args.tp)
    tp = models["dsa"].tp
    say = print if tp.rank == 0 else (lambda *a, **k: None)  # noqa: E731
    tp_extra = dict(tp_size=tp.size, allreduce=tp.reducer.path if tp.reducer is not None else None)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    shapes = [(1, 32768), (64, 8192)] if args.quick else [(b, s) for b in (1, 8, 64) for s in (8192, 32768, 131072)]
    for b, s in shapes:
        per = {}
        for name, model in models.items():
            engine = decoding_engine(model, b, s, g)
            for i in range(WARMUP):
                engine.step()
            returned, produced = [], 0  # steady state: the host schedules step N+1 while the GPU runs step N
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(STEPS):
                produced += len(engine.step())
                returned.append(time.perf_counter())
            torch.cuda.synchronize()
            timing = step_timing(t0, returned, time.perf_counter())
            mean_us = timing["mean_us"]
            assert engine.stats.graph_steps == WARMUP + STEPS and produced == b * STEPS
            graph = engine.runner.graphs[last_step_bucket(b, s, model.config.block_size)]
            replay = timer(graph.graph.replay)
            extra = {}
            if tp.size > 1:  # capture the step again with no all-reduce: the replicated and sharded compute alone
                del graph
                with without_all_reduce():
                    engine.runner.graphs.clear()
                    engine.step()
                    (captured,) = engine.runner.graphs.values()
                bare = timer(captured.graph.replay)
                extra = dict(replay_no_allreduce_us=bare["median_us"],
                             allreduce_share=max(0.0, 1 - bare["median_us"] / replay["median_us"]), note=NO_ALLREDUCE)
            per[name] = mean_us
            single = tp.size == 1  # the targets are TP=1's
            rows.append(result_row("engine_decode", f"{name}+graph", dict(B=b, S=s, layers=model.config.num_hidden_layers),
                                   timing, ceilings, tokens_per_s=b / mean_us * 1e6,
                                   replay_us=replay["median_us"], host_share=max(0.0, 1 - replay["median_us"] / mean_us),
                                   target_tokens_per_s=500.0 if single and (name, b, s) == ("dsa", 1, 32768) else None,
                                   target_host_share=0.10 if single and name == "dsa" and s == 8192 and b in (1, 64)
                                   else None, **tp_extra, **extra))
            r = rows[-1]
            say(f"{name} B={b} S={s} TP={tp.size}: {mean_us:.0f} us/step (median {r['median_us']:.0f}) = "
                f"{r['tokens_per_s']:.0f} tokens/s, graph "
                f"replay {r['replay_us']:.0f} us, host share {100 * r['host_share']:.1f}%"
                + (f", replay without all-reduce {extra['replay_no_allreduce_us']:.0f} us (all-reduce "
                   f"{100 * extra['allreduce_share']:.1f}%)" if extra else ""), flush=True)
            del engine
            torch.cuda.empty_cache()
        rows[-2]["speedup_vs_dense"] = per["dense"] / per["dsa"]
    for name, model in models.items():
        rows.append(prefill_row(name, model, ceilings, tp_extra, say))
    return rows
