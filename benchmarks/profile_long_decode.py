"""Where a B = 1 decode step's device time goes at long contexts (issue #38: decode at 1M >= 0.85x of 128K).

A random preset (default demo-gpu) with room for the longest ``--lengths`` entry, its caches filled with random
latent rows and indexer keys (written by the model's own cache writers, so every position holds a real key), then
for each length one decode row at position ``L - 1`` (``BatchPlan.build``, one request, no prefill): the step's
device time by CUDA events, eager and as a replayed CUDA graph (``--reps`` each), and a ``torch.profiler`` pass
over ``--profile-steps`` eager steps, its kernels by device time per step. Prints each length's step times and
the kernels whose time grows most from the shortest length to the longest, and writes everything (``--out``).

    python benchmarks/profile_long_decode.py [--lengths 131072,524288,1048576] [--preset demo-gpu] --out F.json
"""
import argparse
import json
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dsa.cache import write_indexer_keys, write_latent
from dsa.kernels.common import cdiv
from dsa.model.plan import BatchPlan
from dsa.model.presets import preset_model
from dsa.report import env_info

FILL_ROWS = 1 << 16  # positions written per cache-writer call


def fill_caches(model, caches, tokens: int, seed: int = 0) -> None:
    """Random rows at slots ``0 .. tokens - 1`` of every layer's latent cache and indexer key cache."""
    c, dev = model.config, model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for start in range(0, tokens, FILL_ROWS):
        n = min(FILL_ROWS, tokens - start)
        slots = torch.arange(start, start + n, dtype=torch.int32, device=dev)
        for latent, index in zip(caches.latent, caches.index):
            kv_c = torch.randn(n, c.kv_lora_rank, generator=g, device=dev).to(model.dtype)
            k_pe = torch.randn(n, c.qk_rope_head_dim, generator=g, device=dev).to(model.dtype)
            write_latent(latent, kv_c, k_pe, slots)
            if index is not None:
                write_indexer_keys(index, torch.randn(n, c.index_head_dim, generator=g, device=dev).to(model.dtype),
                                   slots)


def decode_plan(model, length: int) -> BatchPlan:
    """One decode row at position ``length - 1`` of a request whose blocks are ``0 .. ceil(length / P) - 1``."""
    p = model.config.block_size
    table = np.arange(cdiv(length, p), dtype=np.int32)[None]
    return BatchPlan.build([1], [length - 1], table, p, model.device, options=model.plan_options(),
                           input_ids=np.array([7], np.int32))


def event_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` on the stream, one CUDA event pair each."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def kernels(prof, steps: int) -> dict:
    """Device microseconds per step of each kernel name (summed over its calls), and calls per step."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0.0)
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:120]] = {"us": round(us / steps, 2), "calls": e.count / steps}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def measure(model, caches, length: int, reps: int, profile_steps: int) -> dict:
    plan = decode_plan(model, length)
    step = lambda: model.step(plan, caches)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            step()
        eager = event_ms(step, reps)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        replay = event_ms(graph.replay, reps)
        del graph
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                step()
            torch.cuda.synchronize()
    ks = kernels(prof, profile_steps)
    return {"length": length, "eager_ms": round(eager, 4), "graph_ms": round(replay, 4),
            "kernel_us": round(sum(k["us"] for k in ks.values()), 2), "kernels": ks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="131072,524288,1048576")
    p.add_argument("--preset", default="demo-gpu")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("profile_long_decode: needs a CUDA device")
    model = preset_model(args.preset, "cuda")
    model.set_max_model_len(lengths[-1] + 1)
    caches = model.allocate_caches(cdiv(lengths[-1], model.config.block_size))
    fill_caches(model, caches, lengths[-1])
    rows = []
    for length in lengths:
        r = measure(model, caches, length, args.reps, args.profile_steps)
        rows.append(r)
        print(f"{length} keys: eager {r['eager_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms a step, "
              f"kernels {r['kernel_us']:.1f} us", flush=True)
    first, last = rows[0]["kernels"], rows[-1]["kernels"]
    growth = sorted(((last[k]["us"] - first.get(k, {"us": 0.0})["us"], k) for k in last), reverse=True)
    print(f"kernels growing most from {lengths[0]} to {lengths[-1]} keys (us a step):")
    for d, k in growth[:12]:
        print(f"  {d:+9.1f}  {first.get(k, {'us': 0.0})['us']:8.1f} -> {last[k]['us']:8.1f}  {k[:90]}")
    result = {"op": "profile-long-decode", "env": env_info(), "preset": args.preset, "batch": 1, "rows": rows,
              "ratio_graph_longest_to_shortest": round(rows[0]["graph_ms"] / rows[-1]["graph_ms"], 4)}
    with open(args.out, "w") as f:
        json.dump(result, f, separators=(",", ":"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
