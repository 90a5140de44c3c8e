"""``dsa bench indexer``: key write, query prep, paged decode logits, the decode indexer step
(logits + top-k to slots), ragged prefill logits.

Each Triton row is checked against the torch reference on the same inputs before it is timed
(logits: ``calc_diff < 1e-6`` over finite entries and identical ``-inf`` masks; key write and
query prep: equal bytes). Decode rows are timed eagerly and replayed from a CUDA graph
(``+graph``). Targets (:mod:`dsa.bench.targets`) are recorded as ``target_us``. ``--variants`` adds the
Triton launchers' tuning knobs, each row checked bit for bit against the default launch.
"""
import json

import torch

from dsa.kernels import (
    indexer_key_write,
    indexer_key_write_reference,
    indexer_logits_paged,
    indexer_logits_paged_reference,
    indexer_logits_ragged,
    indexer_logits_ragged_hopper as ragged_hopper,
    indexer_logits_ragged_reference,
    indexer_query_prep,
    indexer_query_prep_reference,
    topk_slots,
)
from dsa.testing import calc_diff, random_block_tables

from .harness import result_row
from .targets import INDEXER_PAGED_US, INDEXER_RAGGED_TFLOPS

HI, DI, P, K = 64, 128, 64, 2048


def check_logits(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        raise RuntimeError(f"{name}: the -inf mask differs from the reference")
    diff = calc_diff(out[finite], ref[finite])
    if not diff < 1e-6:
        raise RuntimeError(f"{name}: calc_diff {diff:.3g} against the reference (want < 1e-6)")


def random_index_cache(nb: int, device, g: torch.Generator) -> torch.Tensor:
    """A planar FP8 indexer cache ``uint8 [nb, P * 132]`` of random keys and scales in [0.5, 1.5)."""
    cache = torch.empty(nb, P * (DI + 4), dtype=torch.uint8, device=device)
    cache[:, :P * DI] = (torch.randn(nb, P * DI, generator=g, device=device).clamp(-8, 8)
                         .to(torch.float8_e4m3fn).view(torch.uint8))
    cache[:, P * DI:].view(torch.float32).copy_(torch.rand(nb, P, generator=g, device=device) + 0.5)
    return cache


def paged_inputs(b: int, n: int, s: int, device, seed: int = 0):
    """Random FP8 queries/weights and a random planar cache over non-contiguous blocks."""
    table, nb = random_block_tables([s] * b, P, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator(device=device).manual_seed(seed)
    cache = random_index_cache(nb, device, g)
    q8 = torch.randn(b, n, HI, DI, generator=g, device=device).to(torch.float8_e4m3fn)
    weights = torch.randn(b, n, HI, generator=g, device=device)
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
    return q8, weights, cache, table.to(device), seq_lens


def ragged_inputs(t: int, s: int, device):
    """A prefill chunk of ``t`` random FP8 queries on top of ``s - t`` cached keys (the causal
    tail): ``(q8, weights, k8, k_scale, starts, ends)``."""
    g = torch.Generator(device=device).manual_seed(1)
    q8 = torch.randn(t, HI, DI, generator=g, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(t, HI, generator=g, device=device)
    k8 = torch.randn(s, DI, generator=g, device=device).to(torch.float8_e4m3fn)
    k_scale = torch.rand(s, generator=g, device=device) + 0.5
    starts = torch.zeros(t, dtype=torch.int32, device=device)
    ends = torch.arange(s - t + 1, s + 1, dtype=torch.int32, device=device)
    return q8, w, k8, k_scale, starts, ends


def decode_rows(lens: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lengths [B * N], row_to_req [B * N])`` int32 of the decode rows: row ``b * N + j`` sees
    positions ``[0, S_b - N + j]``."""
    j = torch.arange(n, device=lens.device)
    lengths = (lens.long()[:, None] - n + 1 + j).clamp(0, width).view(-1).to(torch.int32)
    return lengths, torch.arange(len(lens), dtype=torch.int32, device=lens.device).repeat_interleave(n)


def paged_cost(b: int, n: int, s: int) -> tuple[int, int]:
    """(bytes, flops): every key record read once, the logits written once."""
    return b * s * (DI + 4) + b * n * s * 4 + b * n * HI * (DI + 4), 2 * b * n * s * HI * DI


def bench_key_write(device, timer, ceilings, t: int) -> dict:
    nb = (t + P - 1) // P + 1
    k = (torch.randn(t, DI, device=device) * 3).to(torch.bfloat16)
    slots = torch.randperm(nb * P, device=device)[:t]
    cache = torch.zeros(nb, P * (DI + 4), dtype=torch.uint8, device=device)
    expect = cache.clone()
    indexer_key_write(cache, k, slots, P, True)
    indexer_key_write_reference(expect, k, slots, P, True)
    if not torch.equal(cache, expect):
        raise RuntimeError("indexer_key_write: bytes differ from the reference")
    timing = timer(lambda: indexer_key_write(cache, k, slots, P, True))
    return result_row("indexer_key_write", "triton", dict(T=t, DI=DI, hadamard=True), timing, ceilings,
                      bytes_moved=t * (2 * DI + 8 + DI + 4))


def bench_query_prep(device, timer, ceilings, t: int) -> dict:
    q = (torch.randn(t, HI, DI, device=device) * 3).to(torch.bfloat16)
    w = torch.randn(t, HI, device=device)
    q8, weights = indexer_query_prep(q, w, True)
    ref_q8, ref_w = indexer_query_prep_reference(q, w, True)
    if not (torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8)) and torch.equal(weights, ref_w)):
        raise RuntimeError("indexer_query_prep: bytes differ from the reference")
    timing = timer(lambda: indexer_query_prep(q, w, True))
    return result_row("indexer_query_prep", "triton", dict(T=t, HI=HI, DI=DI, hadamard=True), timing, ceilings,
                      bytes_moved=t * HI * (2 * DI + 4 + DI + 4))


def bench_ragged(device, timer, ceilings, t: int, s: int, backend: str = "auto") -> dict:
    """A prefill chunk of ``t`` queries on top of ``s - t`` cached keys (the causal tail); the row's impl
    names the kernel that ran (``hopper``: the Gluon kernel, ``triton``: the portable one)."""
    q8, w, k8, k_scale, starts, ends = ragged_inputs(t, s, device)
    impl = "hopper" if ragged_hopper.use_hopper(backend, device, HI, DI, (q8, k8)) else "triton"
    out = indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend=backend)
    rows = torch.arange(0, t, max(1, t // 64), device=device)  # the reference on a subset of rows
    check_logits("indexer_logits_ragged", out[rows],
                 indexer_logits_ragged_reference(q8[rows], w[rows], k8, k_scale, starts[rows], ends[rows]))
    del out
    timing = timer(lambda: indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend=backend), reps=10)
    flops = 2 * HI * DI * int((ends - starts).sum())
    return result_row("indexer_logits_ragged", impl, dict(T=t, S=s, HI=HI, ranges="causal tail"), timing,
                      ceilings, bytes_moved=t * s * 4 + s * (DI + 4) + t * HI * (DI + 4), flops=flops, bound="fp8",
                      target_us=flops / (INDEXER_RAGGED_TFLOPS * 1e6))


def bench_paged(device, timer, ceilings, b: int, n: int, s: int) -> list:
    """Paged logits (eager and graph), then the decode indexer step (logits + top-k to slots)."""
    rows = []
    q8, w, cache, table, lens = paged_inputs(b, n, s, device)
    out = indexer_logits_paged(q8, w, cache, table, lens, P, s)
    check_logits("indexer_logits_paged", out, indexer_logits_paged_reference(q8, w, cache, table, lens, P, s))
    nbytes, flops = paged_cost(b, n, s)
    shape = dict(B=b, N=n, S=s, HI=HI)
    cost = dict(bytes_moved=nbytes, flops=flops, bound="copy")
    logits = lambda: indexer_logits_paged(q8, w, cache, table, lens, P, s)  # noqa: E731
    target = INDEXER_PAGED_US.get((b, s, n))
    for impl, graph in (("triton", False), ("triton+graph", True)):
        rows.append(result_row("indexer_logits_paged", impl, shape, timer(logits, graph=graph), ceilings, **cost,
                               target_us=target if graph else None))
    if (b, s, n) == (64, 65536, 1):
        t = timer(lambda: indexer_logits_paged_reference(q8, w, cache, table, lens, P), reps=5)
        rows.append(result_row("indexer_logits_paged", "torch-reference", shape, t, ceilings, **cost))
    lengths, row_to_req = decode_rows(lens, n, s)
    pair = lambda: topk_slots(logits(), lengths, K, table, row_to_req, lens, P)  # noqa: E731
    step = dict(shape, k=K)
    rows.append(result_row("indexer_decode_step", "logits+topk_slots+graph", step, timer(pair, graph=True), ceilings,
                           bytes_moved=nbytes, flops=flops, bound="copy"))
    return rows


def run(device, timer, ceilings, args) -> list:
    rows = []
    for t in ([8192] if args.quick else [64, 8192]):
        rows.append(bench_key_write(device, timer, ceilings, t))
        rows.append(bench_query_prep(device, timer, ceilings, t))
    shapes = [(64, 1, 65536)] if args.quick else [(1, 1, 131072), (64, 1, 65536), (64, 2, 65536), (64, 1, 131072)]
    for b, n, s in shapes:
        rows += bench_paged(device, timer, ceilings, b, n, s)
    rows.append(bench_ragged(device, timer, ceilings, 4096, 65536))
    if rows[-1]["impl"] == "hopper":  # the portable kernel beside it, same run
        rows.append(bench_ragged(device, timer, ceilings, 4096, 65536, backend="triton"))
    if getattr(args, "variants", False):
        rows += bench_variants(device, timer, ceilings)
    return rows


# --variants: launcher knobs of the Triton kernels (none changes a bit of the result; each row says
# whether it matched the default's logits bit for bit)
PAGED_VARIANTS = [
    dict(tma=False, max_tiles=16), dict(tma=False, max_tiles=16, stages=5),
    dict(tma=True, stages=3), dict(tma=True, stages=4), dict(tma=True, stages=5), dict(tma=True, stages=6),
    dict(tma=True, max_tiles=16), dict(tma=True, max_tiles=64), dict(tma=True, max_tiles=128),
    dict(tma=True, waves=2), dict(tma=True, max_tiles=256, waves=1),
]
RAGGED_VARIANTS = [
    dict(), dict(tma=True), dict(tma=True, stages=4), dict(stages=4), dict(num_warps=8), dict(block_t=2),
    dict(block_t=2, tma=True, stages=4), dict(block_s=128, block_t=2, num_warps=8, tma=True),
    dict(hopper_kernel=True, stages=2), dict(hopper_kernel=True, stages=4), dict(hopper_kernel=True, stages=6),
]  # hopper_kernel: the Gluon kernel (sm_90)


def _knobs(kw: dict) -> str:
    return "triton " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "default")


def _variant_row(rows, timer, ceilings, name, kw, fn, shape, cost, equal, reps=None, emit=print):
    try:
        out = fn()
    except Exception as exc:  # a config that does not compile or fit
        emit(f"{name} {_knobs(kw)} {shape}: {type(exc).__name__} {exc}"[:400])
        return
    bits = {key: bool(torch.equal(out, ref)) for key, ref in equal.items()}
    del out
    graph = timer(fn, reps, graph=True)
    row = result_row(name, _knobs(kw), shape, timer(fn, reps), ceilings, **cost, graph_us=graph["median_us"],
                     graph_p10_us=graph["p10_us"], graph_p90_us=graph["p90_us"], knobs=kw, **bits)
    rows.append(row)
    emit(json.dumps(row))


def bench_variants(device, timer, ceilings, shapes=((64, 1, 65536), (64, 1, 131072), (64, 2, 65536), (1, 1, 131072)),
                   ragged=(4096, 65536), emit=print) -> list:
    """Every variant of PAGED_VARIANTS at ``shapes`` and of RAGGED_VARIANTS at ``ragged``, eager and
    graph-replayed, each compared bit for bit with the default launch (whose logits are checked
    against the reference)."""
    from dsa.kernels.indexer_logits_paged import _indexer_logits_paged_triton
    from dsa.kernels.indexer_logits_ragged import _indexer_logits_ragged_triton
    rows = []
    for b, n, s in shapes:
        q8, w, cache, table, lens = paged_inputs(b, n, s, device)
        default = _indexer_logits_paged_triton(q8, w, cache, table, lens, P, s)
        check_logits("indexer_logits_paged", default, indexer_logits_paged_reference(q8, w, cache, table, lens, P, s))
        nbytes, flops = paged_cost(b, n, s)
        for kw in PAGED_VARIANTS:
            fn = lambda: _indexer_logits_paged_triton(q8, w, cache, table, lens, P, s, **kw)  # noqa: E731
            _variant_row(rows, timer, ceilings, "indexer_logits_paged", kw, fn, dict(B=b, N=n, S=s, HI=HI),
                         dict(bytes_moved=nbytes, flops=flops, bound="copy"),
                         dict(bitwise_default=default), emit=emit)
        del q8, w, cache, table, lens, default
    t, s = ragged
    q8, w, k8, k_scale, starts, ends = ragged_inputs(t, s, device)
    default = _indexer_logits_ragged_triton(q8, w, k8, k_scale, starts, ends)
    sub = torch.arange(0, t, max(1, t // 64), device=device)
    check_logits("indexer_logits_ragged", default[sub],
                 indexer_logits_ragged_reference(q8[sub], w[sub], k8, k_scale, starts[sub], ends[sub]))
    flops = 2 * HI * DI * int((ends - starts).sum())
    for kw in RAGGED_VARIANTS:
        fn = lambda: _indexer_logits_ragged_triton(q8, w, k8, k_scale, starts, ends, **kw)  # noqa: E731
        shape = dict(T=t, S=s, HI=HI, ranges="causal tail")
        _variant_row(rows, timer, ceilings, "indexer_logits_ragged", kw, fn, shape,
                     dict(bytes_moved=t * s * 4 + s * (DI + 4) + t * HI * (DI + 4), flops=flops, bound="fp8"),
                     dict(bitwise_default=default), reps=10, emit=emit)
    return rows
