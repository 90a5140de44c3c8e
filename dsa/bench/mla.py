"""``dsa bench mla``: sparse absorbed MLA decode/prefill and dense absorbed decode.

Each shape runs the Hopper kernel (on sm_90) and the portable Triton kernel side by side, each timed
eagerly (``median_us``) and under CUDA-graph replay (``graph_us``, what a decode step sees; the targets,
:mod:`dsa.bench.targets`, are graph-replay times). The sparse decode rows draw each request's 2,048
slots among its own CTX = 8,192 rows, independently per row; the ``next_n = 2`` rows also with a real
verify step's overlap (``VERIFY_OVERLAP`` of row 0's slots in row 1, ``shape.overlap``), and three
shapes at the peers' 32K rows per request (``shape.ctx``). ``--variants`` adds tile/split sweeps.
"""
import torch

from dsa.errors import DSAError
from dsa.kernels import (
    dense_mla_decode,
    dense_mla_decode_reference,
    latent_write,
    sparse_mla,
    sparse_mla_hopper as hopper,
    sparse_mla_reference,
)
from dsa.kernels.common import cdiv
from dsa.kernels.sparse_mla import mla_attention_triton
from dsa.testing import random_block_tables

from .harness import result_row
from .targets import MLA_US

H, D_L, D_V, P, K = 128, 576, 512, 64, 2048
SCALE = 0.1352
ROW_BYTES = {"bf16": D_L * 2, "fp8": 656}
CTX = 8192  # rows each decode request owns; its slots are drawn from them
PEER_CTX = 32768  # the peers' side-by-side shape (wave 2: FlashMLA at 32K per request)
# a verify row's slots that its request's row 0 also selected: 0.59 in the trained default's real verify
# steps at 16K (benchmarks/results/verify-overlap-cpu-2cores-2026-12-02-default-16000.json; 0.63 at 4K)
VERIFY_OVERLAP = 0.59
SWEEP = {"bf16": [(64, 2), (32, 2), (16, 4), (32, 4)], "fp8": [(64, 2)]}  # (BLOCK_N, stages) besides the default


def latent_caches(num_tokens: int, device, seed: int = 0) -> dict:
    """The same random rows as a bf16 cache and as a 656-byte FP8 cache (written by latent_write)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb = cdiv(num_tokens, P)
    bf16 = torch.randn(nb, P, D_L, generator=g, device=device).to(torch.bfloat16)
    fp8 = torch.empty(nb, P, ROW_BYTES["fp8"], dtype=torch.uint8, device=device)
    flat = bf16.view(-1, D_L)
    latent_write(fp8, flat[:, :D_V], flat[:, D_V:], torch.arange(nb * P, device=device))
    return {"bf16": bf16, "fp8": fp8}


def decode_slots(b: int, n: int, device, seed: int = 0, ctx: int = CTX, overlap: float | None = None) -> torch.Tensor:
    """[B*N, K] int32: K distinct slots per row among the ``ctx`` rows of its own request, independent
    random rows, or with ``overlap`` (N >= 2, as in a verify step): rows 1 .. N-1 of a request keep
    ``round(overlap * K)`` of row 0's slots and draw the rest among the slots row 0 did not select."""
    g = torch.Generator(device=device).manual_seed(seed)
    req = torch.arange(b, device=device).repeat_interleave(n)[:, None]
    if overlap is None or n == 1:
        pick = torch.rand(b * n, ctx, generator=g, device=device).topk(K, dim=1).indices
        return (req * ctx + pick).to(torch.int32)
    keep = round(overlap * K)
    r = torch.rand(b, n, ctx, generator=g, device=device)
    first = r[:, 0].topk(K, dim=1).indices  # [B, K]
    r[:, 1:].scatter_(2, first[:, None, :].expand(b, n - 1, K), -1.0)  # row 0's slots: no fresh pick
    fresh = r[:, 1:].topk(K - keep, dim=2).indices  # [B, N - 1, K - keep]
    rest = torch.cat((first[:, None, :keep].expand(b, n - 1, keep), fresh), dim=2)
    pick = torch.cat((first[:, None], rest), dim=1).reshape(b * n, K)
    return (req * ctx + pick).to(torch.int32)


def sparse_cost(t: int, k: int, fmt: str = "bf16", h: int = H) -> tuple[int, int]:
    """(bytes, flops): each selected row read once per query row, q read, out written."""
    return t * k * ROW_BYTES[fmt] + t * h * (D_L + D_V) * 2 + t * k * 4, 2 * t * h * k * (D_L + D_V)


def dense_cost(b: int, s: int, n: int = 1, fmt: str = "bf16", h: int = H) -> tuple[int, int]:
    return b * s * ROW_BYTES[fmt] + b * n * h * (D_L + D_V) * 2, 2 * b * n * h * s * (D_L + D_V)


def check(got, want, what: str) -> None:
    """The reference check before any timing: output within 2e-2 of the largest |value| (bf16 rounding
    over a 512-wide latent), LSE within 1e-3."""
    out, lse = got
    ref_out, ref_lse = want
    err = ((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
    lse_err = (lse - ref_lse).abs().max().item()
    if not (err < 2e-2 and lse_err < 1e-3):
        raise DSAError(f"dsa bench mla: {what} disagrees with the reference (out {err:.3g}, lse {lse_err:.3g})")


def add(rows: list, row: dict) -> None:
    """Keep a row and print it at once (a long run shows progress)."""
    rows.append(row)
    graph = f", graph {row['graph_us']:.1f} us" if "graph_us" in row else ""
    print(f"{row['name']} {row['impl']} {row['shape']}: {row['median_us']:.1f} us{graph}, "
          f"{row.get('tflops', 0):.0f} TFLOP/s, {row.get('tbps', 0):.2f} TB/s", flush=True)


def backends(device) -> list[str]:
    """The kernels to time: the Hopper one where it runs, and the portable one."""
    reason = hopper.unsupported_reason(device, H)
    if reason is not None:
        print(f"Hopper kernel not timed: {reason}")
    return (["hopper"] if reason is None else []) + ["triton"]


def timed_row(rows, timer, ceilings, fn, name, impl, shape, nbytes, flops, reps=None, target=None, **extra):
    """Time ``fn`` eagerly and under graph replay; one row with both."""
    eager = timer(fn, reps)
    graph = timer(fn, reps, graph=True)
    seconds = graph["median_us"] * 1e-6
    add(rows, result_row(name, impl, shape, eager, ceilings, bytes_moved=nbytes, flops=flops, bound="bf16",
                         target_us=target, graph_us=graph["median_us"], graph_p10_us=graph["p10_us"],
                         graph_p90_us=graph["p90_us"], graph_tflops=flops / seconds / 1e12, **extra))


def run(device, timer, ceilings, args) -> list:
    rows = []
    impls = backends(device)
    variants = getattr(args, "variants", False)
    caches = latent_caches(128 * (CTX if args.quick else PEER_CTX), device)
    # sparse decode: T = B * N rows, K = 2048 slots each, among CTX rows of each request (independent rows,
    # and next_n = 2 rows with a real verify step's overlap), and at the peers' 32K
    shapes = [(64, 1, CTX, None)] if args.quick else (
        [(b, n, CTX, None) for n in (1, 2) for b in (1, 64, 128)] + [(b, 2, CTX, VERIFY_OVERLAP) for b in (1, 64, 128)]
        + [(64, 1, PEER_CTX, None), (128, 2, PEER_CTX, None), (128, 2, PEER_CTX, VERIFY_OVERLAP)])
    for b, n, ctx, overlap in shapes:
        slots = decode_slots(b, n, device, ctx=ctx, overlap=overlap)
        q = (torch.randn(b * n, H, D_L, device=device) * 0.1).to(torch.bfloat16)
        for fmt, cache in caches.items():
            nbytes, flops = sparse_cost(b * n, K, fmt)
            shape = dict(B=b, N=n, H=H, K=K, cache=fmt, ctx=ctx, overlap=overlap)
            for impl in impls:
                check(sparse_mla(q[:8], cache, slots[:8], SCALE, backend=impl),
                      sparse_mla_reference(q[:8], cache, slots[:8], SCALE), f"sparse decode {fmt} {impl}")
                timed_row(rows, timer, ceilings, lambda: sparse_mla(q, cache, slots, SCALE, backend=impl),
                          "sparse_mla_decode", impl, shape, nbytes, flops,
                          target=MLA_US.get(("sparse_mla_decode", b, n, fmt)) if (ctx, overlap) == (CTX, None)
                          else None)
            if variants and (b, n, ctx) == (64, 1, CTX):
                sweep(rows, timer, ceilings, q, cache, slots, b * n, fmt, nbytes, flops, impls)
        if (b, n, ctx) == (64, 1, CTX):
            t = timer(lambda: sparse_mla_reference(q, caches["bf16"], slots, SCALE), reps=5)
            nbytes, flops = sparse_cost(b * n, K)
            add(rows, result_row("sparse_mla_decode", "torch-reference", dict(B=b, N=n, H=H, K=K, cache="bf16"),
                                   t, ceilings, bytes_moved=nbytes, flops=flops, bound="bf16"))
    # sparse prefill: 4096 query tokens of one 64K-token request
    tp = 4096
    g = torch.Generator(device=device).manual_seed(1)
    slots = torch.rand(tp, 65536, generator=g, device=device).topk(K, dim=1).indices.to(torch.int32)
    q = (torch.randn(tp, H, D_L, device=device) * 0.1).to(torch.bfloat16)
    for fmt in ("bf16",) if args.quick else ("bf16", "fp8"):
        cache = caches[fmt]
        nbytes, flops = sparse_cost(tp, K, fmt)
        for impl in impls:
            check(sparse_mla(q[:8], cache, slots[:8], SCALE, backend=impl),
                  sparse_mla_reference(q[:8], cache, slots[:8], SCALE), f"sparse prefill {fmt} {impl}")
            timed_row(rows, timer, ceilings, lambda: sparse_mla(q, cache, slots, SCALE, backend=impl),
                      "sparse_mla_prefill", impl, dict(T=tp, H=H, K=K, cache=fmt), nbytes, flops, reps=10,
                      target=MLA_US.get(("sparse_mla_prefill", tp, 1, fmt)))
    del caches, slots, q
    # dense absorbed decode, B = 64 requests of S positions in random blocks
    b = 64
    s_max = 32768 if args.quick else 131072
    table, nb = random_block_tables([s_max] * b, P)
    table = table.to(device)
    cache = torch.randn(nb, P, D_L, device=device).to(torch.bfloat16)
    qd = (torch.randn(b, 1, H, D_L, device=device) * 0.1).to(torch.bfloat16)
    for s in (32768,) if args.quick else (8192, 32768, 131072):
        lens = torch.full((b,), s, dtype=torch.int32, device=device)
        nbytes, flops = dense_cost(b, s)
        for impl in impls:
            check(dense_mla_decode(qd[:2], cache, table[:2], lens[:2], SCALE, backend=impl),
                  dense_mla_decode_reference(qd[:2], cache, table[:2], lens[:2], SCALE), f"dense decode {impl}")
            timed_row(rows, timer, ceilings, lambda: dense_mla_decode(qd, cache, table, lens, SCALE, backend=impl),
                      "dense_mla_decode", impl, dict(B=b, N=1, H=H, S=s, cache="bf16"), nbytes, flops, reps=10,
                      target=MLA_US.get(("dense_mla_decode", b, s, "bf16")))
        if s == 32768 and variants and "hopper" in impls:
            fn = lambda: hopper.mla_attention_hopper(  # noqa: E731
                qd.view(-1, D_L), cache, H, b, block_table=table, seq_lens=lens, n=1, h=H,
                length=table.shape[1] * P, softmax_scale=SCALE, splits=2)
            timed_row(rows, timer, ceilings, fn, "dense_mla_decode", "hopper splits=2",
                      dict(B=b, N=1, H=H, S=s, cache="bf16"), nbytes, flops, reps=10)
        if s == 32768:
            t = timer(lambda: dense_mla_decode_reference(qd, cache, table, lens, SCALE), reps=3)
            add(rows, result_row("dense_mla_decode", "torch-reference", dict(B=b, N=1, H=H, S=s, cache="bf16"),
                                   t, ceilings, bytes_moved=nbytes, flops=flops, bound="bf16"))
    return rows


def sweep(rows, timer, ceilings, q, cache, slots, t, fmt, nbytes, flops, impls) -> None:
    """Variants of the sparse decode: the portable kernel's (BLOCK_N, stages), the Hopper kernel's split
    count."""
    shape = dict(B=t, N=1, H=H, K=K, cache=fmt)
    for bn, stages in SWEEP[fmt]:
        fn = lambda: mla_attention_triton(q.view(-1, D_L), cache, H, t, slots=slots,  # noqa: E731
                                          length=K, softmax_scale=SCALE, block_n=bn, num_stages=stages)
        try:
            fn()
        except Exception as exc:  # a config that does not fit (registers, shared memory)
            print(f"sparse decode {fmt} BLOCK_N={bn} stages={stages}: {type(exc).__name__} {exc}"[:300])
            continue
        timed_row(rows, timer, ceilings, fn, "sparse_mla_decode", f"triton BLOCK_N={bn} stages={stages}", shape,
                  nbytes, flops)
    if "hopper" in impls:  # 2 or 4 programs per SM instead of one
        for splits in (2, 4):
            fn = lambda: hopper.mla_attention_hopper(q.view(-1, D_L), cache, H, t, slots=slots,  # noqa: E731
                                                     length=K, softmax_scale=SCALE, splits=splits)
            timed_row(rows, timer, ceilings, fn, "sparse_mla_decode", f"hopper splits={splits}", shape, nbytes,
                      flops)
