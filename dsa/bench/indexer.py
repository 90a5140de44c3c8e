"""``dsa bench indexer``: key write, query prep, paged decode logits, ragged prefill logits."""
import torch

from dsa.kernels import indexer_logits_paged_reference
from dsa.testing import random_block_tables

from .harness import result_row

HI, DI, P = 64, 128, 64


def paged_inputs(b: int, n: int, s: int, device, seed: int = 0):
    """Random FP8 queries/weights and a random planar cache over non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    table, nb = random_block_tables([s] * b, P, generator=g)
    cache = torch.randint(0, 256, (nb, P * (DI + 4)), dtype=torch.uint8, generator=g)
    cache.view(nb, -1)[:, P * DI:].view(torch.float32).copy_(torch.rand(nb, P, generator=g) + 0.5)
    cache[:, :P * DI] = torch.randn(nb, P * DI, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn).view(torch.uint8)
    q8 = torch.randn(b, n, HI, DI, generator=g).to(torch.float8_e4m3fn)
    weights = torch.randn(b, n, HI, generator=g)
    seq_lens = torch.full((b,), s, dtype=torch.int32)
    return [x.to(device) for x in (q8, weights, cache, table, seq_lens)]


def paged_cost(b: int, n: int, s: int) -> tuple[int, int]:
    """(bytes, flops): every key record read once, the logits written once."""
    return b * s * (DI + 4) + b * n * s * 4 + b * n * HI * (DI + 4), 2 * b * n * s * HI * DI


def run(device, timer, ceilings, args) -> list:
    rows = []
    for b, s, n in [(64, 65536, 1)]:
        q8, w, cache, table, lens = paged_inputs(b, n, s, device)
        t = timer(lambda: indexer_logits_paged_reference(q8, w, cache, table, lens, P), reps=5)
        nbytes, flops = paged_cost(b, n, s)
        rows.append(result_row("indexer_logits_paged", "torch-reference", dict(B=b, N=n, S=s, HI=HI), t,
                               ceilings, bytes_moved=nbytes, flops=flops, bound="copy"))
    return rows
