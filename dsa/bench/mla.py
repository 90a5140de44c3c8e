"""``dsa bench mla``: sparse absorbed MLA decode/prefill and dense absorbed decode."""
import torch

from dsa.kernels import dense_mla_decode_reference, sparse_mla_reference
from dsa.testing import random_block_tables

from .harness import result_row

H, D_L, D_V, P = 128, 576, 512, 64
SCALE = 0.1352


def sparse_inputs(t: int, k: int, num_tokens: int, device, seed: int = 0):
    """bf16 queries, a random bf16 latent cache of ``num_tokens`` rows, distinct random slots per row."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-num_tokens // P)
    cache = torch.randn(nb, P, D_L, generator=g).to(torch.bfloat16)
    q = (torch.randn(t, H, D_L, generator=g) * 0.1).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(nb * P, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    return q.to(device), cache.to(device), slots.to(device)


def sparse_cost(t: int, k: int, h: int = H) -> tuple[int, int]:
    """(bytes, flops): each selected row read once per query row, q read, out written."""
    return t * k * D_L * 2 + t * h * (D_L + D_V) * 2 + t * k * 4, 2 * t * h * k * (D_L + D_V)


def dense_cost(b: int, s: int, h: int = H) -> tuple[int, int]:
    return b * s * D_L * 2 + b * h * (D_L + D_V) * 2, 2 * b * h * s * (D_L + D_V)


def run(device, timer, ceilings, args) -> list:
    rows = []
    b, k = 64, 2048
    q, cache, slots = sparse_inputs(b, k, 64 * 4096, device)
    t = timer(lambda: sparse_mla_reference(q, cache, slots, SCALE), reps=5)
    nbytes, flops = sparse_cost(b, k)
    rows.append(result_row("sparse_mla_decode", "torch-reference", dict(B=b, N=1, H=H, K=k, cache="bf16"), t,
                           ceilings, bytes_moved=nbytes, flops=flops, bound="bf16"))
    b, s = 64, 32768
    table, nb = random_block_tables([s] * b, P)
    cache = torch.randn(nb, P, D_L).to(torch.bfloat16).to(device)
    qd = (torch.randn(b, 1, H, D_L) * 0.1).to(torch.bfloat16).to(device)
    lens = torch.full((b,), s, dtype=torch.int32, device=device)
    table = table.to(device)
    t = timer(lambda: dense_mla_decode_reference(qd, cache, table, lens, SCALE), reps=3)
    nbytes, flops = dense_cost(b, s)
    rows.append(result_row("dense_mla_decode", "torch-reference", dict(B=b, N=1, H=H, S=s, cache="bf16"), t,
                           ceilings, bytes_moved=nbytes, flops=flops, bound="bf16"))
    return rows
