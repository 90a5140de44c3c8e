"""Benchmark harness: same-run ceilings, L2-flushed CUDA-event medians, result rows and JSON files.

Method: ceilings first, in the same process (a 4 GiB device-to-device copy
counting read + write; median of repeated 8192^3 bf16 and fp8 products); then each op, checked
against its reference before it is timed; each time is the median of CUDA-event timings with
the L2 flushed before every call.
"""
import json
import os

import torch

L2_FLUSH_BYTES = 256 << 20  # several times the H200's 50 MB L2
COPY_BYTES = 4 << 30
MATMUL_N = 8192


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: the file-name tag of a GPU."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words[:2]) or "gpu"


def graphed(fn):
    """``fn`` captured once in a CUDA graph (after a warm-up call on a side stream, which also
    compiles any Triton kernel); returns the graph's ``replay``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Timer:
    """Median of CUDA-event timings, the L2 flushed (a 256 MiB memset) before every call.

    ``timer(fn)`` times eager calls (host launch cost included); ``timer(fn, graph=True)`` captures
    ``fn`` once in a CUDA graph and times its replays, the flush running eagerly outside the graph:
    the device time of the op as a decode step replays it.
    """

    def __init__(self, device, reps: int = 30, warmup: int = 3, flush: bool = True):
        self.reps, self.warmup = reps, warmup
        self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if flush else None

    def __call__(self, fn, reps: int | None = None, *, graph: bool = False) -> dict:
        reps = reps or self.reps
        if graph:
            fn = graphed(fn)
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in events)  # us
        pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
        return {"median_us": pick(0.5), "p10_us": pick(0.1), "p90_us": pick(0.9), "reps": reps}


def measure_ceilings(device) -> dict:
    """Copy bandwidth (TB/s, read + write) and sustained bf16 / fp8 matmul rates (TFLOP/s)."""
    timer = Timer(device, reps=20, warmup=3, flush=False)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy = timer(lambda: dst.copy_(src))
    del src, dst
    n = MATMUL_N
    flops = 2 * n ** 3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16 = timer(lambda: a @ b, reps=50)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # b8 column-major
    one = torch.ones((), device=device)
    fp8 = timer(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps=50)
    return {
        "copy_tbps": 2 * COPY_BYTES / copy["median_us"] / 1e6,
        "copy_bytes": COPY_BYTES,
        "bf16_tflops": flops / bf16["median_us"] / 1e6,
        "bf16_tflops_p10": flops / bf16["p10_us"] / 1e6,
        "fp8_tflops": flops / fp8["median_us"] / 1e6,
        "fp8_tflops_p10": flops / fp8["p10_us"] / 1e6,
        "matmul_n": n,
    }


def result_row(name: str, impl: str, shape: dict, timing: dict, ceilings: dict, *, bytes_moved: int | None = None,
               flops: int | None = None, bound: str = "copy", target_us: float | None = None, **extra) -> dict:
    """One timed op: time, TB/s and/or TFLOP/s, and the fraction of the same-run ceiling ``bound``
    (``"copy"``, ``"bf16"`` or ``"fp8"``)."""
    row = {"name": name, "impl": impl, "shape": shape, **timing}
    seconds = timing["median_us"] * 1e-6
    if bytes_moved is not None:
        row["bytes"] = int(bytes_moved)
        row["tbps"] = bytes_moved / seconds / 1e12
    if flops is not None:
        row["flops"] = int(flops)
        row["tflops"] = flops / seconds / 1e12
    row["bound"] = bound
    if bound == "copy" and bytes_moved is not None:
        row["frac_ceiling"] = row["tbps"] / ceilings["copy_tbps"]
    elif bound in ("bf16", "fp8") and flops is not None:
        row["frac_ceiling"] = row["tflops"] / ceilings[f"{bound}_tflops"]
    if target_us is not None:
        row["target_us"] = target_us
    row.update(extra)
    return row


def result_path(op: str, env: dict, out_dir: str) -> str:
    return os.path.join(out_dir, f"{op}-{gpu_slug(env.get('gpu', 'cpu'))}-{env['date']}.json")


def write_result(op: str, rows: list, ceilings: dict, env: dict, out_dir: str, args: dict | None = None) -> str:
    """Write ``<out_dir>/<op>-<gpu>-<date>.json`` (:func:`result_path`) and return its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = result_path(op, env, out_dir)
    doc = {"op": op, "env": env, "ceilings": ceilings, "args": args or {}, "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path

