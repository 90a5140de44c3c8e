"""``dsa bench topk``: top-2048 of each logits row (Triton ``topk_indices`` / ``topk_slots``), torch.topk
and the torch reference in the same run. Bytes: the logits read once (the floor).

The Triton op is three launches (scan, place, finish; five on the tile bound of 32 rows and more of 512K
columns and more, the ``[64, 1M]`` row); called eagerly its time includes Triton's host-side launch cost,
so it is also timed replayed from a CUDA graph (``+graph``, how decode runs it).
``--variants`` adds graph-replay rows of the launcher's tuning knobs (the sweep that chose its defaults).
"""
import torch

from dsa.kernels import topk_indices, topk_indices_reference, topk_slots
from dsa.kernels.topk.launch import topk_triton
from dsa.testing import random_block_tables

from .harness import result_row
from .targets import TOPK_SLOTS_SLACK, TOPK_US

K = 2048
P = 64
VARIANTS = [dict(sample=1024, programs=132), dict(sample=1024, programs=132, block=2048), dict(sample=1024),
            dict(programs=132), dict(block=2048), dict(max_chunks=32), dict(max_chunks=64), dict(max_chunks=128),
            dict(min_chunk=8192)]  # each against the defaults of topk_triton


def _check(out, logits, lengths):
    """The same set of positions per row as the reference (the tie rule fixes it)."""
    ref = topk_indices_reference(logits, lengths, K)
    if not torch.equal(out.sort(dim=1).values, ref.sort(dim=1).values):
        raise RuntimeError(f"topk_indices differs from the reference at {list(logits.shape)}")


def run(device, timer, ceilings, args) -> list:
    rows = []
    shapes = [(64, 65536)] if args.quick else [(b, l) for b in (1, 64) for l in (16384, 65536, 131072, 1 << 20)]
    for b, l in shapes:
        logits = torch.randn(b, l, device=device)
        lengths = torch.full((b,), l, dtype=torch.int32, device=device)
        shape, nbytes = dict(B=b, L=l, k=K), b * l * 4
        target = TOPK_US.get((b, l))
        base = lambda: torch.topk(logits, K, dim=1)  # noqa: E731
        for impl, graph in (("torch.topk", False), ("torch.topk+graph", True)):
            rows.append(result_row("topk", impl, shape, timer(base, graph=graph), ceilings, bytes_moved=nbytes))
        _check(topk_indices(logits, lengths, K, backend="triton"), logits, lengths)
        op = lambda: topk_indices(logits, lengths, K, backend="triton")  # noqa: E731
        for impl, graph in (("triton", False), ("triton+graph", True)):
            rows.append(result_row("topk_indices", impl, shape, timer(op, graph=graph), ceilings, bytes_moved=nbytes,
                                   target_us=target if graph else None))
        if target is not None:
            table, _ = random_block_tables([l] * b, P)
            table, row_to_req = table.to(device), torch.arange(b, dtype=torch.int32, device=device)
            op = lambda: topk_slots(logits, lengths, K, table, row_to_req, lengths, P, backend="triton")  # noqa: E731
            rows.append(result_row("topk_slots", "triton+graph", dict(shape, P=P), timer(op, graph=True), ceilings,
                                   bytes_moved=nbytes, target_us=target * TOPK_SLOTS_SLACK))
        for knobs in VARIANTS if getattr(args, "variants", False) else []:
            op = lambda: topk_triton(logits, lengths, K, None, **knobs)  # noqa: E731
            _check(op(), logits, lengths)
            rows.append(result_row("topk_indices", "triton+graph " + " ".join(f"{k}={v}" for k, v in knobs.items()),
                                   shape, timer(op, graph=True), ceilings, bytes_moved=nbytes))
        if (b, l) == (64, 65536):
            t = timer(lambda: topk_indices_reference(logits, lengths, K), reps=10)
            rows.append(result_row("topk_indices", "torch-reference", shape, t, ceilings, bytes_moved=nbytes))
    return rows
