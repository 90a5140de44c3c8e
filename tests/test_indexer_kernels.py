"""Indexer Triton kernels under the CPU interpreter (small odd shapes) against the torch references.

Key write and query prep: written bytes equal the reference exactly. Paged and ragged logits:
``calc_diff < 1e-6`` over finite entries and identical ``-inf`` masks; outputs are NaN-poisoned
before the kernels write them. The GPU twin of this file is ``test_indexer_kernels_gpu.py``.
"""
import importlib

import pytest
import torch

from dsa import kernels as K
from dsa.kernels.common import TRITON_INTERPRET
from dsa.testing import calc_diff, random_block_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not TRITON_INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def nan_outputs(monkeypatch):
    """Float tensors from torch.empty come back NaN-filled, so elements a kernel leaves unwritten fail."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() and out.element_size() >= 2 else out

    monkeypatch.setattr(torch, "empty", poisoned)


def _keys(t, di, gen, scale=4.0):
    k = torch.randn(t, di, generator=gen) * torch.rand(t, 1, generator=gen) * scale
    k[0] = 0.0  # amax below the 1e-4 floor
    k[1, :7] = -0.0
    k[2] *= 1e4  # past the e4m3 range before scaling
    k[3, 5] = 448.0 * 2.0 ** -7  # right at a power-of-two ratio
    return k.to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_key_write_bytes_equal_reference(hadamard, slot_dtype):
    gen = torch.Generator().manual_seed(3)
    t, p, nb = 37, 16, 5
    k = _keys(t, 128, gen)
    slots = torch.randperm(nb * p, generator=gen)[:t]
    slots[[4, 9, 30]] = -1
    slots[11] = -7  # any negative is skipped
    slots = slots.to(slot_dtype).to(DEVICE)
    cache = torch.randint(0, 256, (nb, p * 132), dtype=torch.uint8, generator=gen).to(DEVICE)
    expect = cache.clone()
    K.indexer_key_write(cache, k, slots, p, hadamard, backend="triton")
    K.indexer_key_write(expect, k, slots, p, hadamard, backend="torch")
    assert torch.equal(cache, expect)


def test_key_write_refuses_a_strided_cache():
    cache = torch.zeros(4, 2 * 16 * 132, dtype=torch.uint8, device=DEVICE)[:, : 16 * 132]
    with pytest.raises(ValueError, match="^index_cache"):
        K.indexer_key_write(cache, torch.zeros(3, 128, dtype=torch.bfloat16, device=DEVICE),
                            torch.zeros(3, dtype=torch.long, device=DEVICE), 16, False, backend="triton")


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_query_prep_bytes_equal_reference(hadamard, nan_outputs):
    gen = torch.Generator().manual_seed(5)
    t, hi = 7, 5
    q = _keys(t * hi, 128, gen).view(t, hi, 128)
    w = torch.randn(t, hi, generator=gen).to(DEVICE)
    q8, weights = K.indexer_query_prep(q, w, hadamard, backend="triton")
    ref_q8, ref_w = K.indexer_query_prep(q, w, hadamard, backend="torch")
    assert torch.equal(q8.view(torch.uint8), ref_q8.view(torch.uint8))
    assert torch.equal(weights, ref_w)


def _random_cache(num_blocks, p, gen):
    cache = torch.empty(num_blocks, p * 132, dtype=torch.uint8)
    cache[:, : p * 128] = torch.randn(num_blocks, p * 128, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    cache[:, p * 128:].view(torch.float32).copy_(torch.rand(num_blocks, p, generator=gen) + 0.5)
    return cache


def assert_logits_match(out, ref):
    """Identical -inf masks, no NaN, calc_diff < 1e-6 over the finite entries."""
    assert out.shape == ref.shape and out.dtype == torch.float32
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    assert torch.equal(out[~finite], ref[~finite])  # -inf where the reference has -inf, no NaN
    if finite.any():
        assert calc_diff(out[finite], ref[finite]) < 1e-6


PAGED = [  # (seq_lens, N, HI, block table width or None, max_seq_len)
    ([37, 50, 1], 1, 5, None, None),
    ([40, 33], 3, 7, None, 70),  # width past every row
    ([100, 17], 2, 64, None, 90),  # width cuts a row
    ([70, 20], 2, 3, 3, None),  # positions past the block table are -inf
    ([9, 2], 4, 1, None, 33),  # S < N: an all -inf row; HI = 1
]


@pytest.mark.parametrize("lens,n,hi,table_width,max_seq_len", PAGED,
                         ids=[f"S{'-'.join(map(str, c[0]))}-N{c[1]}-HI{c[2]}-MB{c[3]}-W{c[4]}" for c in PAGED])
def test_paged_logits_match_reference(lens, n, hi, table_width, max_seq_len, nan_outputs):
    gen = torch.Generator().manual_seed(7)
    p = 16
    table, nb = random_block_tables(lens, p, generator=gen, extra_blocks=3)
    if table_width is not None:
        table = table[:, :table_width].contiguous()
    cache = _random_cache(nb, p, gen).to(DEVICE)
    q8 = torch.randn(len(lens), n, hi, 128, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.randn(len(lens), n, hi, generator=gen).to(DEVICE)
    args = (q8, w, cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), p, max_seq_len)
    assert_logits_match(K.indexer_logits_paged(*args, backend="triton"), K.indexer_logits_paged(*args, backend="torch"))


RAGGED = [  # (T, HI, S, ranges)
    (37, 5, 300, "causal"),
    (37, 7, 301, "random"),
    (3, 64, 200, "random"),
    (9, 2, 150, "empty"),
]


@pytest.mark.parametrize("t,hi,s,ranges", RAGGED, ids=[f"T{c[0]}-HI{c[1]}-S{c[2]}-{c[3]}" for c in RAGGED])
def test_ragged_logits_match_reference(t, hi, s, ranges, nan_outputs):
    gen = torch.Generator().manual_seed(11)
    q8 = torch.randn(t, hi, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(t, hi, generator=gen)
    k8 = torch.randn(s, 128, generator=gen).to(torch.float8_e4m3fn)
    k_scale = torch.rand(s, generator=gen) + 0.5
    if ranges == "causal":  # a chunk of t queries on top of a prefix
        ends = torch.arange(s - t + 1, s + 1, dtype=torch.int32)
        starts = torch.zeros(t, dtype=torch.int32)
    else:
        starts = torch.randint(0, s, (t,), generator=gen, dtype=torch.int32)
        ends = (starts + torch.randint(0, s // 2, (t,), generator=gen, dtype=torch.int32)).clamp(max=s)
        if ranges == "empty":
            ends[::2] = starts[::2]
    args = [x.to(DEVICE) for x in (q8, w, k8, k_scale, starts, ends)]
    assert_logits_match(K.indexer_logits_ragged(*args, backend="triton"), K.indexer_logits_ragged(*args, backend="torch"))


TMA_PAGED = [  # (seq_lens, N, HI, block table width or None, max_seq_len) with P = 64: the TMA kernel
    ([200, 64, 1], 1, 5, None, None),
    ([300, 77], 3, 3, 3, 330),  # positions past the block table, width past every row
]


@pytest.mark.parametrize("lens,n,hi,table_width,max_seq_len", TMA_PAGED,
                         ids=[f"S{'-'.join(map(str, c[0]))}-N{c[1]}-HI{c[2]}-MB{c[3]}-W{c[4]}" for c in TMA_PAGED])
def test_paged_logits_tma_kernel_equals_the_pointer_kernel(lens, n, hi, table_width, max_seq_len, nan_outputs):
    """P = 64 takes the TMA kernel (a block a tile; ids outside [0, NB) read TMA's zero fill): its
    logits equal the pointer kernel's bit for bit at any pipeline depth and split, block ids -1,
    -2^31, NB and 2^31 - 1 included, with the cache inside NaN guard bytes."""
    paged = importlib.import_module("dsa.kernels.indexer_logits_paged")
    gen = torch.Generator().manual_seed(17)
    p = 64
    table, nb = random_block_tables(lens, p, generator=gen, extra_blocks=2)
    table[0, 1], table[0, 2], table[-1, 0] = -1, 2 ** 31 - 1, -(2 ** 31)
    table[1, 1] = nb
    if table_width is not None:
        table = table[:, :table_width].contiguous()
    guard = p * 132
    buf = torch.full((guard + nb * p * 132 + guard,), 0xFF, dtype=torch.uint8)
    buf[guard:guard + nb * p * 132] = _random_cache(nb, p, gen).view(-1)
    buf = buf.to(DEVICE)
    cache = buf[guard:guard + nb * p * 132].view(nb, p * 132)
    q8 = torch.randn(len(lens), n, hi, 128, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.randn(len(lens), n, hi, generator=gen).to(DEVICE)
    args = (q8, w, cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), p, max_seq_len)
    pointer = paged._indexer_logits_paged_triton(*args, tma=False)
    assert_logits_match(pointer, K.indexer_logits_paged(*args, backend="torch"))
    assert torch.equal(K.indexer_logits_paged(*args, backend="triton"), pointer)  # the TMA kernel by default
    assert torch.equal(paged._indexer_logits_paged_triton(*args, tma=True, stages=2, max_tiles=1, waves=1), pointer)


def test_ragged_logits_tile_and_tma_variants_equal_the_default(nan_outputs):
    """The ragged launcher's knobs (TMA loads, tile sizes, warps) change no logit; S past the last
    full tile reads TMA's zero fill."""
    ragged = importlib.import_module("dsa.kernels.indexer_logits_ragged")
    gen = torch.Generator().manual_seed(19)
    t, hi, s = 11, 7, 301
    ends = torch.arange(s - t + 1, s + 1, dtype=torch.int32)
    starts = torch.randint(0, 100, (t,), generator=gen, dtype=torch.int32)
    args = [x.to(DEVICE) for x in (torch.randn(t, hi, 128, generator=gen).to(torch.float8_e4m3fn),
                                   torch.randn(t, hi, generator=gen),
                                   torch.randn(s, 128, generator=gen).to(torch.float8_e4m3fn),
                                   torch.rand(s, generator=gen) + 0.5, starts, ends)]
    default = ragged._indexer_logits_ragged_triton(*args)
    assert_logits_match(default, K.indexer_logits_ragged(*args, backend="torch"))
    for kw in (dict(tma=True, stages=4, block_t=2), dict(block_s=128, num_warps=8, waves=4)):
        assert torch.equal(ragged._indexer_logits_ragged_triton(*args, **kw), default), kw


GRIDS = [(64, 1 << 20, 264), (256, 1 << 20, 264), (4096, 1 << 16, 264), (1, 3000, 264), (5, 65, 7), (1000, 64, 264),
         (64, 1 << 20, 132)]


@pytest.mark.parametrize("t,s,slots", GRIDS, ids=[f"T{t}-S{s}-slots{n}" for t, s, n in GRIDS])
def test_ragged_grid_stays_within_one_wave(t, s, slots):
    """The ragged launch splits the key axis so that its programs fit ``slots`` whenever its row tiles
    do (17 splits of 16 row tiles, 272 programs for 264 slots, cost a second wave on the H200), and its
    splits cover every key tile once, none empty."""
    ragged = importlib.import_module("dsa.kernels.indexer_logits_ragged")
    (t_tiles, splits), per_prog = ragged.ragged_grid(t, s, 4, 64, slots)
    s_tiles = -(-s // 64)
    assert t_tiles == -(-t // 4)
    assert t_tiles * splits <= max(slots, t_tiles), f"{t_tiles} x {splits} programs for {slots} slots"
    assert (splits - 1) * per_prog < s_tiles <= splits * per_prog, (splits, per_prog, s_tiles)
    if t_tiles <= slots // 2 and s_tiles >= slots:
        assert t_tiles * splits > slots // 2, f"{t_tiles} x {splits} programs leave half of {slots} slots idle"


WAVE_GRIDS = GRIDS + [(400, 160000, 132), (671, 100000, 132), (300, 220000, 132), (600, 6000, 132), (1, 131073, 132)]


@pytest.mark.parametrize("t,s,slots", WAVE_GRIDS, ids=[f"T{t}-S{s}-slots{n}" for t, s, n in WAVE_GRIDS])
def test_wave_grid_fills_its_last_wave(t, s, slots):
    """The Hopper kernel's grid (one program a SM) covers every key tile once, none empty, and its modelled
    time never exceeds the one-wave rule's: 100 row tiles of 160K keys, unsplit on 132 SMs (76% busy), split
    five ways fill four waves to 95%; at the model's 1M and 512K calls it is the one-wave grid."""
    ragged = importlib.import_module("dsa.kernels.indexer_logits_ragged")
    (t_tiles, splits), per = ragged.wave_grid(t, s, 4, 64, slots)
    s_tiles = -(-s // 64)
    assert t_tiles == -(-t // 4)
    assert (splits - 1) * per < s_tiles <= splits * per, (splits, per, s_tiles)

    def cost(splits, per):
        return -(-t_tiles * splits // slots) * (per + ragged.SETUP_TILES)

    (_, one_wave), one_per = ragged.ragged_grid(t, s, 4, 64, slots)
    assert cost(splits, per) <= cost(one_wave, one_per), (splits, per, one_wave, one_per)
    if (t, s, slots) in ((64, 1 << 20, 132), (128, 1 << 19, 132)):
        assert (splits, per) == (one_wave, one_per)
    if (t, s, slots) == (400, 160000, 132):
        assert t_tiles * splits / (-(-t_tiles * splits // slots) * slots) > 0.9, splits


def test_logits_kernels_refuse_more_than_128_heads():
    q8 = torch.zeros(1, 1, 129, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    cache = torch.zeros(1, 16 * 132, dtype=torch.uint8, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^q8"):
        K.indexer_logits_paged(q8, torch.zeros(1, 1, 129, device=DEVICE), cache, torch.zeros(1, 1, **i32),
                               torch.ones(1, **i32), 16, backend="triton")
    with pytest.raises(ValueError, match="^q8"):
        K.indexer_logits_ragged(q8[0], torch.zeros(1, 129, device=DEVICE),
                                torch.zeros(4, 128, dtype=torch.float8_e4m3fn, device=DEVICE),
                                torch.ones(4, device=DEVICE), torch.zeros(1, **i32), torch.ones(1, **i32),
                                backend="triton")


BAD_BLOCK_IDS = [-1, -(2 ** 31), "NB", "NB+5", 2 ** 31 - 1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_logits_blocks_outside_the_cache_are_minus_inf(backend, nan_outputs):
    """Block ids outside [0, NB) read nothing: their positions are -inf, every other logit is unchanged.
    The cache sits inside a buffer whose guard bytes are NaN, so a read outside it would show."""
    gen = torch.Generator().manual_seed(13)
    p, lens = 16, [70, 45, 33]
    table, nb = random_block_tables(lens, p, generator=gen)
    guard = 3 * p * 132
    buf = torch.full((guard + nb * p * 132 + guard,), 0xFF, dtype=torch.uint8)
    cache = buf[guard:guard + nb * p * 132].view(nb, p * 132)
    cache.copy_(_random_cache(nb, p, gen))
    buf = buf.to(DEVICE)
    cache = buf[guard:guard + nb * p * 132].view(nb, p * 132)
    q8 = torch.randn(3, 2, 5, 128, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.randn(3, 2, 5, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    good = K.indexer_logits_paged(q8, w, cache, table.to(DEVICE), seq_lens, p, 80, backend="torch")
    bad_table = table.clone()
    hits = [(0, 1), (0, 4), (1, 0), (1, 2), (2, 1)]
    for (b, j), bad in zip(hits, BAD_BLOCK_IDS):
        bad_table[b, j] = nb + (5 if bad == "NB+5" else 0) if isinstance(bad, str) else bad
    out = K.indexer_logits_paged(q8, w, cache, bad_table.to(DEVICE), seq_lens, p, 80, backend=backend)
    expect = good.clone().view(3, 2, 80)
    for b, j in hits:
        expect[b, :, j * p:(j + 1) * p] = float("-inf")
    assert_logits_match(out, expect.view(6, 80))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_seq_len", [None, 0, 40], ids=["Wnone", "W0", "W40"])
def test_paged_logits_of_an_empty_batch(backend, max_seq_len):
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = K.indexer_logits_paged(torch.zeros(0, 2, 4, 128, dtype=torch.float8_e4m3fn, device=DEVICE),
                                 torch.zeros(0, 2, 4, device=DEVICE), torch.zeros(3, 16 * 132, dtype=torch.uint8,
                                                                                   device=DEVICE),
                                 torch.zeros(0, 5, **i32), torch.zeros(0, **i32), 16, max_seq_len, backend=backend)
    assert out.shape == (0, max_seq_len or 0) and out.dtype == torch.float32
