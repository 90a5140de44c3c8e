"""Host memory per distinct GEMM shape on a GPU (issue #37): whether a bf16 ``F.linear`` keeps host
memory for each new number of rows M, as cuBLASLt's heuristics cache does (an LRU of
``CUBLASLT_HEURISTICS_CACHE_CAPACITY`` entries, 8192 by default), and whether that growth stops at
the cache's capacity.

A prefill step's GEMMs have M = the step's token count, which varies from step to step in a server,
so each new count is a new cuBLAS shape for every weight. This calls ``F.linear`` on a
``[2048, 2048]`` bf16 weight (and a ``[7168, 2048]`` one: another N, the same cache) for M = 1, 2,
... in sweeps of 1024 new values, and reports glibc's heap in use (``mallinfo2``) and anonymous
resident memory per new shape after each sweep, then the first 1024 values again.

    python benchmarks/gemm_host_memory.py [--json out/gemm-host-memory.json] [--max-rows 16384] [--device cpu]
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from dsa.report import env_info
from dsa.serve.host_memory import resident_by_kind

SWEEP = 1024


def memory() -> tuple:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    r = resident_by_kind()
    return r["malloc_in_use"], r["resident_anon"]


def sweep(rows, weights, label: str) -> dict:
    x = torch.randn(rows[-1], weights[0].shape[1], device=weights[0].device, dtype=torch.bfloat16)
    m0, a0 = memory()
    t0 = time.perf_counter()
    for m in rows:
        for w in weights:
            F.linear(x[:m], w)
    m1, a1 = memory()
    n = len(rows) * len(weights)
    row = {"sweep": label, "rows": [rows[0], rows[-1]], "shapes": n,
           "malloc_in_use_bytes_per_shape": round((m1 - m0) / n), "resident_anon_bytes_per_shape": round((a1 - a0) / n),
           "us_per_call": round(1e6 * (time.perf_counter() - t0) / n, 1), "malloc_in_use_mib": round(m1 / 2**20)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--max-rows", type=int, default=16384, help="the largest M (default: 16384)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to compare")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gemm_host_memory: --device cuda needs a CUDA GPU")
    g = torch.Generator(device=args.device).manual_seed(0)
    weights = [torch.randn(n, 2048, device=args.device, dtype=torch.bfloat16, generator=g) for n in (2048, 7168)]
    sweep(range(1, 9), weights, "warm-up")
    rows = [sweep(range(lo, min(lo + SWEEP, args.max_rows + 1)), weights, f"new M {lo}..")
            for lo in range(9, args.max_rows + 1, SWEEP)]
    rows.append(sweep(range(9, min(9 + SWEEP, args.max_rows + 1)), weights, "the first sweep's M again"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"op": "gemm-host-memory", "env": env_info(), "sweeps": rows}, f, indent=1)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
