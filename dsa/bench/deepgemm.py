"""``dsa bench deepgemm``: our indexer logits against DeepGEMM's on the same inputs (``deep_gemm``
built from source must be importable).

Paged decode logits, replayed from a CUDA graph: ours (``triton+graph``); ``backend="deepgemm"`` as
the model calls it, schedule + kernel + the ``-inf`` masking (``deepgemm+graph``); DeepGEMM's kernel
alone on a schedule made beforehand (``deep_gemm-kernel+graph``, what vLLM pays per layer). Ragged
prefill logits, eager: ours and ``backend="deepgemm"``. Before timing, the two results must have
the same ``-inf`` mask and ``calc_diff < 1e-6``; each DeepGEMM row records the parity of its logits
with ours (``dsa.testing.topk_agreement`` at k = 2048: max |diff|, calc_diff, rows whose top-k sets
differ, and the largest gap of a differing position to the k-th value over the row's largest diff).
"""
import torch

from dsa.errors import DSAError
from dsa.kernels import deepgemm, indexer_logits_paged, indexer_logits_ragged
from dsa.testing import topk_agreement

from .harness import result_row
from .indexer import DI, HI, K, P, check_logits, decode_rows, paged_cost, paged_inputs, ragged_inputs

PAGED_SHAPES = [(64, 1, 65536), (64, 1, 131072), (1, 1, 131072), (64, 2, 65536)]  # (B, N, S)


def bench_paged(device, timer, ceilings, b: int, n: int, s: int) -> list:
    import deep_gemm
    q8, w, cache, table, lens = paged_inputs(b, n, s, device)
    ours = lambda: indexer_logits_paged(q8, w, cache, table, lens, P, s)  # noqa: E731
    theirs = lambda: indexer_logits_paged(q8, w, cache, table, lens, P, s, backend="deepgemm")  # noqa: E731
    out, ref = theirs(), ours()
    check_logits("indexer_logits_paged backend='deepgemm'", out, ref)
    lengths, _ = decode_rows(lens, n, s)
    parity = topk_agreement(ref, out, lengths, K)
    del out, ref
    ctx = lengths.view(b, n).contiguous()  # every row's window [0, S - N + j] lies in the table
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, P, deep_gemm.get_num_sms())
    kv, w2 = cache.view(cache.shape[0], P, 1, DI + 4), w.view(b * n, HI)
    kernel = lambda: deep_gemm.fp8_paged_mqa_logits(q8, kv, w2, ctx, table, meta, s, False)  # noqa: E731
    nbytes, flops = paged_cost(b, n, s)
    shape, cost = dict(B=b, N=n, S=s, HI=HI), dict(bytes_moved=nbytes, flops=flops, bound="copy")
    return [result_row("indexer_logits_paged", "triton+graph", shape, timer(ours, graph=True), ceilings, **cost),
            result_row("indexer_logits_paged", "deepgemm+graph", shape, timer(theirs, graph=True), ceilings, **cost,
                       parity=parity),
            result_row("indexer_logits_paged", "deep_gemm-kernel+graph", shape, timer(kernel, graph=True), ceilings,
                       **cost)]


def bench_ragged(device, timer, ceilings, t: int, s: int) -> list:
    """A prefill chunk of ``t`` queries on top of ``s - t`` cached keys (the causal tail)."""
    q8, w, k8, k_scale, starts, ends = ragged_inputs(t, s, device)
    ours = lambda: indexer_logits_ragged(q8, w, k8, k_scale, starts, ends)  # noqa: E731
    theirs = lambda: indexer_logits_ragged(q8, w, k8, k_scale, starts, ends, backend="deepgemm")  # noqa: E731
    out, ref = theirs(), ours()
    check_logits("indexer_logits_ragged backend='deepgemm'", out, ref)
    sub = torch.arange(0, t, max(1, t // 64), device=device)  # the top-k of a subset of rows
    parity = topk_agreement(ref[sub], out[sub], ends[sub], K)
    parity.update(max_abs_diff_all_rows=float((out - ref)[torch.isfinite(ref)].abs().max()))
    del out, ref
    flops = 2 * HI * DI * int((ends - starts).sum())
    shape = dict(T=t, S=s, HI=HI, ranges="causal tail")
    cost = dict(bytes_moved=t * s * 4 + s * (DI + 4) + t * HI * (DI + 4), flops=flops, bound="fp8")
    return [result_row("indexer_logits_ragged", "triton", shape, timer(ours, reps=10), ceilings, **cost),
            result_row("indexer_logits_ragged", "deepgemm", shape, timer(theirs, reps=10), ceilings, **cost,
                       parity=parity)]


def run(device, timer, ceilings, args) -> list:
    if not deepgemm.available():
        raise DSAError("dsa bench deepgemm: deep_gemm is not importable (build it from "
                         "github.com/deepseek-ai/DeepGEMM)")
    rows = []
    for b, n, s in PAGED_SHAPES[:1] if args.quick else PAGED_SHAPES:
        rows += bench_paged(device, timer, ceilings, b, n, s)
    rows += bench_ragged(device, timer, ceilings, 4096, 65536)
    return rows
