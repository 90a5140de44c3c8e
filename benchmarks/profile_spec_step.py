"""Where a speculating decode step's time goes (issue #39): ``torch.profiler`` over a warm pass.

Builds the model as ``dsa bench engine --speculative-tokens N`` does (the embedded trained default and
its MTP module, or ``--preset`` with ``--draft-acceptance P``: the test drafter), runs one B = 1 request of
``--context`` prompt tokens and ``--new`` greedy tokens twice on a plain engine (CUDA graphs) and on a
speculating one (the first pass compiles and captures), then a third pass of each under the profiler
(from its first streamed token: the decode steps).
Prints and writes (``--out``) the ops by host time and by device time, the steps' wall time, and a
Chrome trace of each profiled pass (``trace-plain.json.gz``, ``trace-spec.json.gz``).

    python benchmarks/profile_spec_step.py [--preset demo-gpu --draft-acceptance 0.7] [--context S] --out DIR
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dsa.bench.speculative import NEW, decode, prompt_ids, set_acceptance, spec_model
from dsa.engine import Engine
from dsa.engine.sampling import SamplingParams
from dsa.kernels.common import cdiv
from dsa.report import env_info

TOP = 30


def table(prof, key: str) -> list:
    """The ``TOP`` ops by ``key`` (``self_cpu_time_total`` or ``device_time_total``), microseconds."""
    ev = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    ev.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"op": e.key[:90], "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1),
             "cpu_us": round(e.cpu_time_total, 1), "device_us": round(getattr(e, "device_time_total", 0.0), 1)}
            for e in ev[:TOP]]


def profiled(engine, ids, new: int, trace: str) -> dict:
    """A third pass, profiled from its first streamed token to its last (the decode steps only)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine.reset_stats()
    prof = profile(activities=activities)
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    t0 = None
    for _ in engine.stream([ids], sampling=sp):
        if t0 is None:
            prof.start()
            t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    prof.stop()
    tmp = trace + ".tmp"
    prof.export_chrome_trace(tmp)
    with open(tmp, "rb") as f, gzip.open(trace, "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(tmp)
    spec = engine.stats.spec.as_dict() if engine.speculative_tokens else None
    return {"decode_s": seconds, "ms_per_token": 1e3 * seconds / (new - 1), "graph_steps": engine.stats.graph_steps,
            "spec": spec, "by_host_time": table(prof, "self_cpu_time_total"),
            "by_device_time": table(prof, "device_time_total")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="a random preset (with --draft-acceptance), default: the trained model")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--draft-acceptance", type=float, default=None)
    p.add_argument("--speculative-tokens", type=int, default=2)
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default: the model's longest)")
    p.add_argument("--new", type=int, default=NEW, help=f"greedy tokens per pass (default {NEW})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.preset and args.draft_acceptance is None:
        raise SystemExit("profile_spec_step: --preset needs --draft-acceptance (its MTP module is random)")
    os.makedirs(args.out, exist_ok=True)
    model, tok, name = spec_model(args, torch.device(args.device))
    c, n = model.config, args.speculative_tokens
    s = args.context or c.max_position_embeddings - args.new - n - 1
    ids = prompt_ids(model, tok, s)
    blocks = cdiv(s + args.new + n + 1, c.block_size) + 1
    plain = Engine(model, num_blocks=blocks, prefix_caching=False)
    (base,), t_plain, _, _ = decode(plain, ids, args.new)
    drafter = None if args.draft_acceptance is None else set_acceptance(base, ids, n, c.vocab_size, args.draft_acceptance)
    spec = Engine(model, num_blocks=blocks, prefix_caching=False, speculative_tokens=n, drafter=drafter)
    _, t_spec, _, warm = decode(spec, ids, args.new)
    print(f"{name} S={s} N={n}: warm pass {1e3 * t_plain / (args.new - 1):.2f} ms/token plain, "
          f"{1e3 * t_spec / (args.new - 1):.2f} speculating ({warm}); {spec.stats.spec.as_dict()}", flush=True)
    result = {"op": "profile-spec-step", "env": env_info(), "model": name, "S": s, "N": n, "new": args.new,
              "warm_plain_s": t_plain, "warm_spec_s": t_spec, "warm_spec": warm,
              "plain": profiled(plain, ids, args.new, os.path.join(args.out, "trace-plain.json.gz")),
              "spec": profiled(spec, ids, args.new, os.path.join(args.out, "trace-spec.json.gz"))}
    for which in ("plain", "spec"):
        r = result[which]
        print(f"\n== {which}: {r['ms_per_token']:.2f} ms a token, {r['graph_steps']} graph steps, spec {r['spec']}")
        for key in ("by_host_time", "by_device_time"):
            print(f"-- {key}")
            for row in r[key][:20]:
                print(f"  {row['self_cpu_us']:>10.0f} {row['device_us']:>10.0f} {row['calls']:>6}  {row['op']}")
    with open(os.path.join(args.out, "profile-spec-step.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}/profile-spec-step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
