"""Host memory of an in-process ``Engine`` under the soak's mix (no HTTP): where ``dsa serve``'s
resident memory goes per request, the server taken out (issue #37).

The requests are ``dsa bench serve --soak``'s plan (:func:`dsa.bench.soak.soak_plan`, the same seed:
prompts of 16-4,096 byte tokens, ``max_tokens`` 1-128 and four times that for ``long``, stop strings
``"e"`` / ``" the"``, streams dropped after 1-3 deltas (aborted), bad requests (rejected by the
sampling checks), chats through the byte tokenizer's template), sent burst by burst (each burst's
requests added at once, the engine stepped until every one finished, as the soak's client waits for
each burst); temperature 0 as the soak asks. At ``--samples`` points of the plan (each once the
engine is idle) it reads the resident memory (``VmRSS``), resident memory by kind and glibc's heap
(``mallinfo2``: in use, free; :func:`dsa.serve.host_memory.resident_by_kind`), the bytes
tracemalloc traces (``--tracemalloc``: slower), the Python objects alive, the engine's host
structures (``dsa_host_structure_entries``) and the prefix cache's evictions (the first sample
after one marks the pool full). A least-squares line over the second half's samples gives bytes
per request (and after the pool is full). Between the sample nearest the half-way point and the
end it diffs tracemalloc snapshots by traceback, ``gc.get_objects()`` by type and
``/proc/self/smaps`` by mapping.

On CUDA the engine warms up (``Engine.warmup``) and ``gc.freeze()`` runs after it, as ``dsa serve``
does. ``--preset small-rows`` is a one-layer model with the FP8 latent, small rows (hidden 64) and
blocks of 16, so a pool of as many blocks as demo-gpu's on an H200 (~344K) fits on a CPU (4.4 GB);
its ``index_topk`` is demo-gpu's (2048), so its prefill rows take the same dense/sparse paths.
``--preset stub`` runs no model at all (:class:`RoutingStub`): the engine's host side with demo-gpu's
routing on an H200, in milliseconds a step. Every run counts the distinct shapes of the MHA prefill's
SDPA calls (``mha_shapes``): cuDNN attention keeps a plan for each (issue #37).

    python benchmarks/host_memory_engine.py --device cpu --preset small-rows --num-blocks 350000 --requests 3000
    python benchmarks/host_memory_engine.py --device cpu --preset stub --num-blocks 32768 --requests 5000 \
        --fit-soak benchmarks/results/soak-h200-2026-12-02-pool32k.json
    python benchmarks/host_memory_engine.py --device cuda --preset demo-gpu --requests 2000 [--tracemalloc]

Writes ``--json`` (default ``out/host-memory-engine/host-memory-engine-<device>-<preset>-<date>.json``)
and the figure beside it (``.png``).
"""
import argparse
import collections
import datetime
import gc
import json
import os
import re
import sys
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import torch

from dsa.bench.soak import soak_plan
from dsa.config import DSAConfig
from dsa.engine.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
from dsa.report import env_info, save_figure
from dsa.serve.host_memory import freeze_after_warmup, resident_by_kind, structure_sizes
from dsa.serve.tokenizer import ByteTokenizer

STOP = ("e", " the")  # the soak's stop strings


def small_rows_config(index_topk: int = 2048) -> DSAConfig:
    """One layer, hidden 64, the FP8 latent (656 B a token), blocks of 16 and demo-gpu's index_topk:
    12.6 kB a block with the indexer's keys, so 350K blocks (as many host entries as demo-gpu's
    ~344K blocks of 64 on an H200) are 4.4 GB."""
    return DSAConfig.tiny(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                          q_lora_rank=32, n_routed_experts=None, index_n_heads=2, index_topk=index_topk, block_size=16,
                          kv_cache_format="fp8", max_position_embeddings=8192, vocab_size=BYTE_VOCAB_SIZE,
                          bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID)


def build_model(preset: str, device: torch.device, seed: int, index_topk: int = 2048):
    from dsa.model import DSAModel
    from dsa.model.presets import preset_model
    if preset == "stub":
        return RoutingStub()
    if preset == "small-rows":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return DSAModel.random(small_rows_config(index_topk), seed=seed, dtype=dtype, device=device)
    return preset_model(preset, device, seed=seed)


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def smaps_by_mapping() -> dict:
    """Resident bytes per mapping name (``/proc/self/smaps``): a file's path, ``[heap]``, ``[stack]``,
    ``[anon]`` for unnamed anonymous mappings (glibc's arenas and mmapped chunks, torch's CPU tensors,
    pinned host memory unless a driver file names it)."""
    out = collections.Counter()
    name = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                m = _MAPPING.match(line)
                if m:
                    name = m.group(1).strip() or "[anon]"
                elif line.startswith("Rss:") and name is not None:
                    out[name] += int(line.split()[1]) * 1024
    except OSError:
        return {}
    return dict(out)


MHA_SHAPES: set = set()  # (query rows, keys, behind a prefix) of every MHA prefill segment (SDPA's shapes)


def count_mha_shapes() -> None:
    """Record each step's MHA prefill segments (the plan's ``route.mha``: one SDPA call per layer each)
    in :data:`MHA_SHAPES`, for any model (the stub's too)."""
    from dsa.model.plan import HostPlan
    real = HostPlan.pack

    def pack(cls, *args, **kwargs):
        host = real(*args, **kwargs)
        MHA_SHAPES.update((seg.num_rows, seg.num_keys, seg.pos0 > 0) for seg in host.route.mha)
        return host
    HostPlan.pack = classmethod(pack)


class RoutingStub:
    """``--preset stub``: demo-gpu's routing on the H200 (``index_topk`` 2048, MHA from 512 dense rows,
    its up-projected K/V bytes per token, the packaged dispatch file's threshold) with no kernels: a step
    returns zero logits (greedy token 0: no request stops early), so the engine schedules, chunks and
    routes the soak's requests as ``dsa serve --preset demo-gpu`` does on an H200, in milliseconds."""

    def __init__(self):
        from dsa.model.presets import PRESETS
        self.config = PRESETS["demo-gpu"]()
        self.device, self.dtype = torch.device("cpu"), torch.bfloat16

    def modules(self):
        return iter(())

    def allocate_caches(self, num_blocks: int):
        return SimpleNamespace(num_blocks=num_blocks)

    def plan_options(self):
        from dsa.model.dispatch import Dispatch
        from dsa.model.route import PlanOptions
        c = self.config
        kv = c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim + 2 * c.qk_head_dim) * 2  # bf16
        return PlanOptions(index_topk=c.index_topk, dispatch=Dispatch(c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim,
                                                                      prefill_mha_min_query=512),
                           mha_kv_bytes_per_token=kv)

    def step(self, plan, caches, logits_rows=None) -> torch.Tensor:
        return torch.zeros(len(plan.query_lens), self.config.vocab_size)


def sample(engine, requests: int, t0: float, traced: bool) -> dict:
    """The gauges now (module docstring)."""
    gc.collect()
    res = resident_by_kind() or {}
    st = engine.stats
    row = {"requests": requests, "seconds": round(time.perf_counter() - t0, 2), "rss": vm_rss(), **res,
           "gc_objects": len(gc.get_objects()), "cached_blocks": st.prefix.cached_blocks,
           "evictions": st.prefix.evictions, "steps": st.steps, "mha_shapes": len(MHA_SHAPES),
           "structures": structure_sizes(engine, None)}
    if traced:
        row["traced"] = tracemalloc.get_traced_memory()[0]
    if engine.model.device.type == "cuda":
        row["gpu_allocated"] = torch.cuda.memory_allocated(engine.model.device)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            try:
                h = stats()
                row["pinned_reserved"] = h.get("reserved_bytes.current", h.get("allocated_bytes.current"))
            except RuntimeError:
                pass
    return row


def slope(samples: list, key: str, start: float) -> float | None:
    """Bytes per request of ``key``: a least-squares line through the samples from ``start`` requests
    on (None with fewer than 3)."""
    pts = [(s["requests"], s[key]) for s in samples if s["requests"] >= start and s.get(key) is not None]
    if len(pts) < 3:
        return None
    x, y = np.array(pts, dtype=np.float64).T
    return float(np.polyfit(x, y, 1)[0])


class Soak:
    """Runs the plan on one engine, burst by burst (module docstring)."""

    def __init__(self, engine, tok, plan: list):
        self.engine, self.tok, self.plan = engine, tok, plan
        self.outcomes = collections.Counter()
        self.tokens = 0

    def prompt(self, item: dict) -> list:
        if item["kind"].startswith("chat"):
            return self.tok.apply_chat_template([{"role": "user", "content": item["text"]}], add_generation_prompt=True)
        return item["prompt"]

    def burst(self, items: list) -> None:
        live = {}
        for item in items:
            kind = item["kind"]
            if kind == "bad":  # the server's checks reject it before the engine; negative max_tokens is the engine's
                try:
                    SamplingParams(max_tokens=-1, temperature=0.0)
                except ValueError:
                    self.outcomes["bad:clean_error"] += 1
                continue
            state = {"kind": kind, "deltas": 0, "reason": None,
                     "cut": item["cut"] if kind == "disconnect" else None}

            def on_output(d, s=state):
                s["deltas"] += 1
                self.tokens += len(d.token_ids)
                if d.finished:
                    s["reason"] = d.finish_reason

            sp = SamplingParams(max_tokens=item["max_tokens"], temperature=0.0, stop=STOP if kind == "stop" else ())
            live[self.engine.add_request(self.prompt(item), sampling=sp, on_output=on_output)] = state
        while live:
            if not self.engine._step()[0] and all(s["reason"] is None for s in live.values()):
                raise RuntimeError("requests are waiting but none can be scheduled")
            for rid, s in list(live.items()):
                if s["reason"] is None and s["cut"] is not None and s["deltas"] >= s["cut"]:
                    self.engine.abort(rid)  # the client dropped the stream
                    s["reason"] = "dropped"
                if s["reason"] is not None:
                    self.outcomes[f"{s['kind']}:{s['reason']}"] += 1
                    del live[rid]
        while self.engine.has_work():  # a step still in flight after the last request ended
            self.engine.step()


def top_tracebacks(snap0, snap1, n_requests: int, limit: int = 12) -> list:
    rows = []
    for d in snap1.compare_to(snap0, "traceback")[:limit]:
        if d.size_diff <= 0:
            continue
        frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in d.traceback]
        rows.append({"bytes": d.size_diff, "bytes_per_request": round(d.size_diff / n_requests, 1),
                     "blocks": d.count_diff, "traceback": frames[-8:]})
    return rows


SOAK_HEAP = 'dsa_resident_memory_bytes{kind="malloc_in_use"}'


def fit_soak(samples: list, soak_json: str) -> dict | None:
    """A ``dsa bench serve --soak`` JSON's glibc heap in use (``malloc_in_use``) against this run's MHA
    shapes met by the same request counts (the same plan, scheduled alike): a least-squares line's
    bytes per new shape, its correlation against shapes and against requests, and what is left per
    request after it (the residual's slope)."""
    with open(soak_json) as f:
        trace = json.load(f)["summary"]["memory_trace"]
    shapes = {s["requests"]: s["mha_shapes"] for s in samples}
    pts = [(shapes[m["requests"]], m[SOAK_HEAP], m["requests"]) for m in trace
           if m["requests"] in shapes and SOAK_HEAP in m]
    if len(pts) < 3:
        return None
    x, y, n = np.array(pts, dtype=np.float64).T
    b, a = np.polyfit(x, y, 1)
    return {"soak": soak_json, "points": [[int(i), int(j), int(k)] for i, j, k in pts],
            "malloc_in_use_bytes_per_mha_shape": float(b), "intercept_bytes": float(a),
            "corr_with_mha_shapes": float(np.corrcoef(x, y)[0, 1]), "corr_with_requests": float(np.corrcoef(n, y)[0, 1]),
            "residual_bytes_per_request": float(np.polyfit(n, y - (a + b * x), 1)[0]),
            "residual_std_bytes": float((y - (a + b * x)).std())}


def plot_fit(ax, fit: dict) -> None:
    x, y, _ = np.array(fit["points"], dtype=np.float64).T
    ax.plot(x, y / 2**20, "o", ms=4, label="soak's malloc_in_use at the same request counts")
    xs = np.array([x.min(), x.max()])
    b = fit["malloc_in_use_bytes_per_mha_shape"]
    ax.plot(xs, (fit["intercept_bytes"] + b * xs) / 2**20, "k--", lw=1,
            label=f"{b / 2**20:.2f} MiB per shape, r = {fit['corr_with_mha_shapes']:.4f}")
    ax.set_title("the soak's C heap against the MHA prefill shapes met", fontsize=10)
    ax.set_xlabel("distinct SDPA shapes of the MHA prefill (this run)")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)


def plot(result: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["samples"]
    x = np.array([r["requests"] for r in s])
    fit = result.get("soak_fit")
    fig, axes = plt.subplots(1, 2 if fit else 1, figsize=(13 if fit else 7.5, 4.2))
    ax = axes[0] if fit else axes
    if fit:
        plot_fit(axes[1], fit)
    for key, label in (("rss", "resident memory (VmRSS)"), ("malloc_in_use", "glibc heap in use (mallinfo2)"),
                       ("traced", "traced by tracemalloc")):
        if all(key in r for r in s):
            ax.plot(x, [r[key] / 2**20 for r in s], "o-", ms=3, label=label)
    k = result["slopes_bytes_per_request"]["rss"]
    if k is not None:
        tail = [r for r in s if r["requests"] >= result["requests"] / 2]
        b = np.mean([r["rss"] for r in tail]) - k * np.mean([r["requests"] for r in tail])
        xs = np.array([tail[0]["requests"], tail[-1]["requests"]])
        ax.plot(xs, (b + k * xs) / 2**20, "k--", lw=1, label=f"fit over the second half: {k:,.0f} B/request")
    if result["pool_full_at"] is not None:
        ax.axvline(result["pool_full_at"], color="gray", ls=":", label="pool full (prefix cache evicts)")
    a = result["args"]
    ax.set_title(f"in-process Engine soak: host memory ({a['preset']}, {a['device']}, {result['num_blocks']:,} blocks)")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.dirname(path) or ".", os.path.basename(path))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--preset", default="small-rows", help="small-rows, stub (module docstring), tiny, demo-cpu, demo-gpu")
    p.add_argument("--index-topk", type=int, default=2048,
                   help="small-rows only: its index_topk (2048 as demo-gpu's; a CPU soak takes 64: the CPU's "
                        "reference sparse kernel gathers index_topk latent rows per prompt row)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="cache blocks (default: on CUDA 80%% of the free memory, as dsa serve; on CPU 350000)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64, help="the soak's: bursts of 1 .. 2x this many requests")
    p.add_argument("--input-len-range", type=int, nargs=2, default=(16, 4096))
    p.add_argument("--max-tokens-range", type=int, nargs=2, default=(1, 128))
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracemalloc", type=int, nargs="?", const=25, default=0, metavar="FRAMES",
                   help="trace Python allocations with this many frames (25 when given bare; slower)")
    p.add_argument("--cudnn-sdpa", action="store_true",
                   help="let the MHA prefill's SDPA use cuDNN attention again (the code before the fix of issue "
                        "#37: dsa.model.attention.MHA_SDPA_BACKENDS), to measure the two in turn")
    p.add_argument("--no-warmup", action="store_true", help="skip Engine.warmup on CUDA")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--fit-soak", default=None, metavar="SOAK_JSON",
                   help="fit that soak's malloc_in_use against this run's MHA shapes at the same request counts")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from dsa.model import attention
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.cudnn_sdpa:
        from torch.nn.attention import SDPBackend
        attention.MHA_SDPA_BACKENDS = [*attention.MHA_SDPA_BACKENDS, SDPBackend.CUDNN_ATTENTION]
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    tok = ByteTokenizer()
    t_load = time.perf_counter()
    model = build_model(args.preset, device, args.seed, args.index_topk)
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = None if device.type == "cuda" else 350_000
    kw = {"num_blocks": num_blocks} if num_blocks else {"memory_bytes": int(0.8 * torch.cuda.mem_get_info(device)[0])}
    engine = Engine(model, max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs, tokenizer=tok, **kw)
    warm = engine.warmup(progress=False) if device.type == "cuda" and not args.no_warmup else None
    frozen = freeze_after_warmup()
    plan_args = SimpleNamespace(seed=args.seed, num_requests=args.requests, concurrency=args.concurrency,
                                input_len_range=tuple(args.input_len_range), input_len=None,
                                max_tokens_range=tuple(args.max_tokens_range), max_tokens=None)
    plan = soak_plan(plan_args, tok)
    bursts = collections.defaultdict(list)
    for item in plan:
        bursts[item["burst"]].append(item)
    print(f"{args.preset} on {device}: {engine.num_blocks:,} blocks, {len(plan)} requests in {len(bursts)} bursts; "
          f"loaded and warmed in {time.perf_counter() - t_load:.1f} s, {frozen} objects frozen", flush=True)

    count_mha_shapes()
    soak = Soak(engine, tok, plan)
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    t0 = time.perf_counter()
    samples = [sample(engine, 0, t0, bool(args.tracemalloc))]
    half = None  # (requests, tracemalloc snapshot, gc types, smaps) at the sample nearest the half-way point
    done = 0
    for items in bursts.values():
        soak.burst(items)
        done += len(items)
        if done >= len(samples) * len(plan) / args.samples or done == len(plan):
            samples.append(sample(engine, done, t0, bool(args.tracemalloc)))
            r = samples[-1]
            print(f"{done:6d} requests {r['seconds']:7.1f} s  rss {r['rss'] / 2**20:8.1f} MiB  "
                  f"malloc_in_use {r.get('malloc_in_use', 0) / 2**20:8.1f}  free {r.get('malloc_free', 0) / 2**20:6.1f}"
                  + (f"  traced {r['traced'] / 2**20:7.1f}" if args.tracemalloc else "")
                  + f"  objects {r['gc_objects']}  mha shapes {r['mha_shapes']}  cached {r['cached_blocks']}  evictions {r['evictions']}", flush=True)
            if half is None and done >= len(plan) / 2:
                half = (done, tracemalloc.take_snapshot() if args.tracemalloc else None,
                        collections.Counter(type(o).__name__ for o in gc.get_objects()), smaps_by_mapping())
    end_types = collections.Counter(type(o).__name__ for o in gc.get_objects())
    end_smaps = smaps_by_mapping()
    n_after = len(plan) - half[0]
    top = top_tracebacks(half[1], tracemalloc.take_snapshot(), n_after) if args.tracemalloc else None
    if args.tracemalloc:
        tracemalloc.stop()
    full = next((s["requests"] for s in samples if s["evictions"] > 0), None)
    keys = ("rss", "resident_anon", "malloc_in_use", "malloc_free", "traced", "gc_objects", "mha_shapes")
    types = {k: v for k, v in (end_types - half[2]).most_common(12)}
    smaps = sorted(((k, end_smaps.get(k, 0) - half[3].get(k, 0)) for k in set(end_smaps) | set(half[3])),
                   key=lambda kv: -abs(kv[1]))[:8]
    result = {
        "op": "host-memory-engine", "env": env_info(), "args": vars(args), "argv": sys.argv,
        "num_blocks": engine.num_blocks, "requests": len(plan),
        "sdpa_backends": [b.name for b in attention.MHA_SDPA_BACKENDS],
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None, "warmup": warm, "frozen_objects": frozen,
        "seconds": round(time.perf_counter() - t0, 1), "outcomes": dict(sorted(soak.outcomes.items())),
        "generated_tokens": soak.tokens, "steps": engine.stats.steps, "pool_full_at": full,
        "slopes_bytes_per_request": {k: slope(samples, k, len(plan) / 2) for k in keys},
        "slopes_after_full_bytes_per_request": None if full is None else {k: slope(samples, k, full) for k in keys},
        "second_half": {"from_requests": half[0], "objects_by_type": types,
                        "smaps_by_mapping_bytes": dict(smaps), "tracemalloc_top": top},
        "samples": samples,
    }
    if args.fit_soak:
        result["soak_fit"] = fit = fit_soak(samples, args.fit_soak)
        if fit:
            print(f"{args.fit_soak}: malloc_in_use = {fit['intercept_bytes'] / 2**20:.0f} MiB + "
                  f"{fit['malloc_in_use_bytes_per_mha_shape']:,.0f} B x MHA shapes (r = {fit['corr_with_mha_shapes']:.4f}; "
                  f"against requests r = {fit['corr_with_requests']:.4f}); left: "
                  f"{fit['residual_bytes_per_request']:,.0f} B per request")
    slopes = result["slopes_bytes_per_request"]
    print("slope over the second half, bytes per request: "
          + ", ".join(f"{k} {v:,.0f}" if abs(v) >= 10 else f"{k} {v:.3f}" for k, v in slopes.items() if v is not None),
          flush=True)
    print(f"pool full at request {full}; objects grown in the second half: {types}")
    print("smaps growth in the second half (bytes):", dict(smaps))
    for row in top or []:
        print(f"  {row['bytes_per_request']:10,.1f} B/request  {row['blocks']:+7d} blocks  {' <- '.join(reversed(row['traceback']))}")
    path = args.json or os.path.join(
        "out", "host-memory-engine",
        f"host-memory-engine-{device.type}-{args.preset}-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path, "and", plot(result, os.path.splitext(path)[0] + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
