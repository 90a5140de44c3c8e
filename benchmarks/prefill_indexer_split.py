"""Where the prefill indexer's time goes at long context (issue #38): one ragged-logits call of the model's
chunked loop (``indexer/lightning.py``: ``RAGGED_CHUNK_ELEMS // S`` query rows against ``S`` keys), split
into the logits kernel and the top-k's kernels, then the launchers' tuning knobs at that shape, each
checked against the default launch. Graph replay, L2 flushed, scaled to ``--rows`` query rows (a prefill
chunk); the top-k kernels' split from ``torch.profiler`` over eager calls.

    python benchmarks/prefill_indexer_split.py [--lengths 65536,262144,524288,1048576] [--rows 4096] --out F.json
"""
import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dsa.bench.harness import Timer, measure_ceilings
from dsa.bench.indexer import DI, HI, K, P, ragged_inputs
from dsa.kernels import indexer_logits_ragged, indexer_logits_ragged_hopper as hopper, topk_slots
from dsa.kernels.indexer_logits_ragged import _indexer_logits_ragged_triton
from dsa.kernels.topk.launch import bound_tile, topk_triton
from dsa.report import env_info
from dsa.testing import calc_diff

CHUNKS = (1 << 26, 1 << 28)  # rows x keys per call: the model's RAGGED_CHUNK_ELEMS, and 4x it
# the tile bound (kernels/topk/bound.py) off (the sampled guess at every width); its tile widths (the default:
# bound_tile(S)), its top bits found, its tile-maxima programs; the guess's sample and programs
TOPK_KNOBS = [dict(bound_tiles=1 << 30), dict(tile=16), dict(tile=32), dict(tile=64), dict(bound_bits=32),
              dict(bound_bits=12), dict(tile_programs=264), dict(sample=2048), dict(programs=1056)]
# the portable kernel (where the Gluon one is the default), and the Gluon kernel's key buffers
LOGITS_KNOBS = [dict(hopper_kernel=False), dict(hopper_kernel=True, stages=2), dict(hopper_kernel=True, stages=3),
                dict(hopper_kernel=True, stages=6), dict(waves=4)]


def kernel_split(fn, calls: int = 5) -> dict:
    """Device microseconds per call of each kernel ``fn`` launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key[:60]: round(e.device_time_total / calls, 2) for e in prof.key_averages() if e.device_time_total > 0}


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def split_at(dev, timer, ceilings, s: int, elems: int, rows: int, knobs: bool, split=kernel_split) -> dict:
    r = max(1, min(rows, elems // s))
    q8, w, k8, k_scale, starts, ends = ragged_inputs(r, s, dev)
    table = torch.arange(s // P, dtype=torch.int32, device=dev)[None]
    seq = torch.tensor([s], dtype=torch.int32, device=dev)
    logits_fn = lambda: indexer_logits_ragged(q8, w, k8, k_scale, starts, ends)  # noqa: E731  (the model's kernel)
    logits = logits_fn()
    topk_fn = lambda: topk_slots(logits, ends, K, table, starts, seq, P, backend="triton")  # noqa: E731
    pair_fn = lambda: topk_slots(logits_fn(), ends, K, table, starts, seq, P, backend="triton")  # noqa: E731
    scale = rows / r
    flops = 2 * HI * DI * int(ends.sum()) * scale
    t = {name: timer(fn, graph=True)["median_us"] for name, fn in
         (("logits", logits_fn), ("topk", topk_fn), ("pair", pair_fn))}
    impl = "hopper" if hopper.use_hopper("auto", dev, HI, DI, (q8, k8)) else "triton"
    row = dict(S=s, chunk_elems=elems, bound_tile=bound_tile(s), logits_impl=impl, rows_per_call=r, calls=rows // r,
               rows=rows,
               **{f"{k}_us_per_call": round(v, 2) for k, v in t.items()},
               **{f"{k}_ms_per_{rows}_rows": round(v * scale / 1e3, 3) for k, v in t.items()},
               pair_tflops=round(flops / (t["pair"] * scale * 1e-6) / 1e12, 1),
               logits_tflops=round(flops / (t["logits"] * scale * 1e-6) / 1e12, 1),
               pair_frac_fp8=round(flops / (t["pair"] * scale * 1e-6) / 1e12 / ceilings["fp8_tflops"], 3),
               topk_tbps=round(r * s * 4 / (t["topk"] * 1e-6) / 1e12, 3),
               topk_kernels_us=split(topk_fn))
    print(json.dumps({k: v for k, v in row.items() if k != "topk_kernels_us"}), row["topk_kernels_us"], flush=True)
    if knobs:
        ref = topk_triton(logits, ends, K, None)
        row["topk_knobs"] = []
        for kw in TOPK_KNOBS:
            fn = lambda: topk_triton(logits, ends, K, None, **kw)  # noqa: E731
            ok = same_sets(fn(), ref)
            us = timer(fn, graph=True)["median_us"]
            row["topk_knobs"].append(dict(knobs=kw, us_per_call=round(us, 2), same_sets=ok))
            print(f"  topk {kw}: {us:.1f} us (default {t['topk']:.1f}), same sets: {ok}", flush=True)
        row["logits_knobs"] = []
        for kw in LOGITS_KNOBS:
            fn = lambda: _indexer_logits_ragged_triton(q8, w, k8, k_scale, starts, ends, **kw)  # noqa: E731
            try:
                out = fn()
                finite = torch.isfinite(logits)
                ok, diff = torch.equal(out, logits), calc_diff(out[finite], logits[finite])
                same_inf = torch.equal(torch.isfinite(out), finite)
                del out
            except Exception as e:  # a tile that does not fit (out of shared memory or registers)
                row["logits_knobs"].append(dict(knobs=kw, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"  logits {kw}: {type(e).__name__}", flush=True)
                continue
            us = timer(fn, graph=True)["median_us"]
            row["logits_knobs"].append(dict(knobs=kw, us_per_call=round(us, 2), bitwise_default=ok, calc_diff=diff,
                                            same_inf_mask=same_inf))
            print(f"  logits {kw}: {us:.1f} us (default {t['logits']:.1f}), bitwise: {ok}, diff {diff:.2e}, "
                  f"masks equal: {same_inf}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536,262144,524288,1048576")
    ap.add_argument("--rows", type=int, default=4096, help="query rows of the prefill chunk the times scale to")
    ap.add_argument("--no-knobs", action="store_true", help="the default launches only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True, help="JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_indexer_split.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    ceilings = measure_ceilings(dev)
    timer = Timer(dev, reps=args.reps)
    rows = [split_at(dev, timer, ceilings, int(s), elems, args.rows, not args.no_knobs and elems == CHUNKS[0])
            for s in args.lengths.split(",") for elems in CHUNKS]
    with open(args.out, "w") as f:
        json.dump(dict(op="prefill_indexer_split", env=env_info(), ceilings=ceilings, args=vars(args),
                       command_line="python " + " ".join(sys.argv), rows=rows), f, separators=(",", ":"))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
