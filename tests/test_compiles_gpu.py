"""No kernel variant is built on the request path: after a warm-up, steps of fresh sizes compile nothing.

Every public op with a Triton kernel runs at the warm-up sizes (one step per split / no-split and
dense / sparse top-k regime, since those are constexpr choices), then at 30 random sizes (batch rows,
lengths, block-table widths, token counts: 1, odd values, primes, multiples of 16), with the int tables
passed as views at odd int32 offsets, as a step's plan passes them. ``dsa.kernels.compiles`` counts the
variants Triton builds (compiled or loaded from its disk cache); any new one fails the test with its
kernel name and key. One exception is reported, not failed: the top-k finish kernel's tile
(``FAST, CB, W``: constexprs sized for the expected candidate list of the step's width) changes with
the width, and a variant that differs from a warmed one only in those constexprs is listed.
"""
import random

import pytest
import torch

from dsa import kernels as K
from dsa.kernels import compiles
from dsa.kernels.layouts import indexer_bytes_per_token

pytestmark = pytest.mark.gpu
DEV = "cuda"
P = 64  # block size
NB = 1024  # cache blocks: 64K positions
HI, DI = 64, 128  # indexer heads, head dim
H = 64  # attention heads (a multiple of 64: the Hopper kernel runs on sm_90)
TOPK = 2048
SCALE = 0.1352
SIZES = [1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 37, 48, 61, 64, 97, 127, 128, 131, 160, 199]
WIDTHS = [1, 7, 16, 100, 1000, 2047, 2048, 2049, 3001, 4096, 8191, 9973, 16384, 30011, 65536 - 64]


def _view(values: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``values`` (int32) as a view at a random int32 offset of a larger buffer, like a plan's views."""
    off = rng.randrange(0, 8)
    buf = torch.empty(off + values.numel(), dtype=torch.int32, device=DEV)
    out = buf[off:].view(values.shape)
    out.copy_(values)
    return out


def _fp8(*shape):
    return torch.randint(0, 120, shape, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def caches():
    return dict(
        index64=torch.randint(0, 120, (NB, P * indexer_bytes_per_token(DI)), dtype=torch.uint8, device=DEV),
        index16=torch.randint(0, 120, (NB * 4, 16 * indexer_bytes_per_token(DI)), dtype=torch.uint8, device=DEV),
        latent_bf16=torch.randn(NB, P, 576, dtype=torch.bfloat16, device=DEV),
        latent_fp8=torch.randint(0, 120, (NB, P, 656), dtype=torch.uint8, device=DEV))


def _step(caches, rng: random.Random, b: int, t: int, width: int, s: int):
    """One call of every op: ``b`` decode requests with contexts up to ``width``, ``t`` prefill tokens
    against ``s`` keys."""
    g = torch.Generator(device=DEV).manual_seed(rng.randrange(1 << 30))
    seq = torch.randint(1, width + 1, (b,), device=DEV, generator=g, dtype=torch.int32)
    seq[0] = width
    mb = -(-width // P) + rng.randrange(0, 3)  # table width: at least the context, sometimes more
    table = torch.randint(-1, NB, (b, mb), device=DEV, generator=g, dtype=torch.int32)
    table_v, seq_v = _view(table, rng), _view(seq, rng)
    slots = _view(torch.randint(-1, NB * P, (t,), device=DEV, generator=g, dtype=torch.int32), rng)

    # indexer: key write, query prep, paged logits (TMA at P = 64, the pointer kernel at P = 16), top-k
    K.indexer_key_write(caches["index64"], torch.randn(t, DI, dtype=torch.bfloat16, device=DEV), slots, P, True)
    K.indexer_query_prep(torch.randn(t, HI, DI, dtype=torch.bfloat16, device=DEV),
                         torch.randn(t, HI, device=DEV), True)
    q8, w = _fp8(b, 1, HI, DI), torch.randn(b, 1, HI, device=DEV)
    extra = rng.choice([0, 0, 1, 15, 16, 33])
    logits = K.indexer_logits_paged(q8, w, caches["index64"], table_v, seq_v, P, max_seq_len=width + extra)
    table16 = _view(torch.randint(-1, NB * 4, (b, -(-width // 16)), device=DEV, generator=g, dtype=torch.int32), rng)
    K.indexer_logits_paged(q8, w, caches["index16"], table16, seq_v, 16, max_seq_len=width)
    K.topk_indices(logits, seq_v, TOPK)
    K.topk_slots(logits, seq_v, TOPK, table_v, _view(torch.arange(b, dtype=torch.int32, device=DEV), rng), seq_v, P)

    # ragged logits of t prefill rows against s keys (row slices, as the model's chunks), top-k with starts
    r0 = rng.randrange(0, 5)
    q8_all, w_all = _fp8(r0 + t, HI, DI), torch.randn(r0 + t, HI, device=DEV)
    ends = torch.randint(0, s + 1, (t,), device=DEV, generator=g, dtype=torch.int32)
    starts = torch.minimum(torch.randint(0, s + 1, (t,), device=DEV, generator=g, dtype=torch.int32), ends)
    starts_v, ends_v = _view(starts, rng), _view(ends, rng)
    ragged = K.indexer_logits_ragged(q8_all[r0:], w_all[r0:], _fp8(s, DI), torch.rand(s, device=DEV), starts_v, ends_v)
    K.topk_indices(ragged, ends_v - starts_v, TOPK, starts_v)

    # attention: latent write, sparse MLA over TOPK slots, dense absorbed decode; both kernels, both caches
    for name in ("latent_bf16", "latent_fp8"):
        cache = caches[name]
        K.latent_write(cache, torch.randn(t, 512, dtype=torch.bfloat16, device=DEV),
                       torch.randn(t, 64, dtype=torch.bfloat16, device=DEV), slots)
        sel = torch.randint(-1, NB * P, (t, TOPK), device=DEV, generator=g, dtype=torch.int32)
        for backend in ("triton", "auto"):  # auto: the Hopper kernel on sm_90
            K.sparse_mla(torch.randn(t, H, 576, dtype=torch.bfloat16, device=DEV), cache, sel, SCALE, backend=backend)
            K.dense_mla_decode(torch.randn(b, 1, H, 576, dtype=torch.bfloat16, device=DEV), cache, table_v, seq_v,
                               SCALE, backend=backend)


def _split_key(key: str):
    """(key without the constexpr parameters, the constexpr parameters) of a compiles key."""
    head, _, args = key.partition("; ")
    parts = args.split(", ")
    constexprs = tuple(p for p in parts if "=" in p and "==" not in p and ":" not in p)
    return (head, tuple(p for p in parts if p not in constexprs)), constexprs


def test_no_variant_after_warm_up(caches):
    compiles.install()
    rng = random.Random(0)
    for b, t, width, s in ((1, 1, 100, 17), (1, 1, 30011, 4097), (200, 256, 1000, 1000), (200, 256, 65536 - 64, 8000)):
        _step(caches, rng, b, t, width, s)  # split and unsplit grids, dense-only and sparse top-k
    torch.cuda.synchronize()
    warm = compiles.counts()
    for _ in range(30):
        _step(caches, rng, rng.choice(SIZES), rng.choice(SIZES + [256, 311]), rng.choice(WIDTHS),
              rng.choice([1, 17, 256, 1000, 2049, 4097, 8000]))
    torch.cuda.synchronize()
    new = {k: n - warm.get(k, 0) for k, n in compiles.counts().items() if n > warm.get(k, 0)}
    warmed = {(name, _split_key(key)[0]) for name, key in warm}
    tiles = {k: n for k, n in new.items() if k[0] == "_finish_kernel" and (k[0], _split_key(k[1])[0]) in warmed}
    for (name, key), n in sorted(tiles.items()):
        print(f"top-k finish tile variant (constexprs only): {n} x {name} [{key}]")
    bad = {k: n for k, n in new.items() if k not in tiles}
    assert not bad, "variants built after warm-up:\n" + "\n".join(
        f"  {n} x {name} [{key}]" for (name, key), n in sorted(bad.items()))
