"""Triton top-k (``topk_indices`` / ``topk_slots``) under the CPU interpreter, at small odd shapes.

Selections are compared with the reference as sets: the tie rule (lowest positions win at the k-th
value; NaN ranks by its bits) fixes the set, so both backends must pick the same positions. ``block=64, programs=40`` splits rows of a few hundred columns into several chunks, so the
cross-chunk offsets and the candidate spans are exercised as on the GPU.
"""
import numpy as np
import pytest
import torch

from dsa import kernels as K
from dsa.kernels.slots import positions_to_slots_reference
from dsa.kernels.topk import topk_indices_reference
from dsa.kernels.topk.launch import topk_triton
from dsa.kernels.topk.reference import order_key

SMALL = dict(block=64, programs=24, min_chunk=64)
POISON = -7  # never a valid output: rows must overwrite every element


def check_topk(out, logits, lengths, k, starts=None, ref=None):
    """Every row: ``min(k, length)`` distinct in-range positions then -1; dense rows exactly 0..n-1;
    longer rows a valid top-k whose ties at the k-th value went to the lowest positions, and (given
    ``ref``) the same set of positions as the reference."""
    r, width = logits.shape
    st = torch.zeros(r, dtype=torch.long, device=logits.device) if starts is None else starts.long()
    ln = torch.minimum(lengths.long(), (width - st).clamp_min(0)).clamp_min(0)
    slot = torch.arange(k, device=logits.device)
    written = slot[None, :] < ln.clamp_max(k)[:, None]  # [R, k]
    out = out.long()
    assert torch.all(out[~written] == -1), "padding must be -1 at the end of the row"
    assert torch.all((out >= 0) & (out < ln[:, None]) | ~written), "positions out of range"
    spread = torch.where(written, out, width + slot).sort(dim=1).values
    assert torch.all(spread[:, 1:] > spread[:, :-1]), "repeated positions"
    dense = ln <= k
    assert torch.equal(out[dense], torch.where(written, slot, -1)[dense]), "a short row must be 0..length-1"
    long_rows = (~dense).nonzero().flatten()
    if len(long_rows) == 0:
        return
    keys = order_key(logits)[long_rows]  # [R', L] int64, a total order (NaN by its bits)
    cols = torch.arange(width, device=logits.device)
    s, n = st[long_rows, None], ln[long_rows, None]
    valid = (cols >= s) & (cols < s + n)
    picked = torch.zeros_like(valid).scatter_(1, out[long_rows] + s, True)
    lowest = torch.where(picked, keys, torch.iinfo(torch.int64).max).min(dim=1).values
    rest = torch.where(valid & ~picked, keys, torch.iinfo(torch.int64).min).max(dim=1).values
    assert torch.all(lowest >= rest), "a selected value is below an unselected valid one"
    # tie rule: an unselected valid column holding the k-th value lies after every selected one holding it
    at_kth = valid & (keys == lowest[:, None])
    last_picked = torch.where(picked & at_kth, cols, -1).max(dim=1).values
    first_left = torch.where(~picked & at_kth, cols, width).min(dim=1).values
    assert torch.all(last_picked < first_left), "a tie at the k-th value did not go to the lowest positions"
    if ref is not None:
        mine, theirs = out[long_rows].sort(dim=1).values, ref[long_rows].long().sort(dim=1).values
        bad = (mine != theirs).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad[:8]} select other positions than the reference"


def adversarial_rows(width, k, g):
    """One row per kind: random, all equal, two values, 10-bit values, NaN/inf garbage past the length,
    NaN inside, -inf and +inf, values differing only in their low 16 bits, a threshold tie far larger than k (overflows any bounded candidate
    buffer), and one row of only -inf. Returns ``(logits [R, width], lengths [R], starts [R])``."""
    rows = {
        "random": torch.randn(width, generator=g),
        "constant": torch.full((width,), 3.0),
        "two_values": torch.randint(0, 2, (width,), generator=g).float(),
        "quant10": (torch.randn(width, generator=g) * 64).round().clamp(-512, 511) / 64,
        "garbage_tail": torch.randn(width, generator=g),
        "nan_inside": torch.where(torch.rand(width, generator=g) < 0.3, float("nan"), torch.randn(width, generator=g)),
        "inf": torch.where(torch.rand(width, generator=g) < 0.4, float("-inf"), torch.randn(width, generator=g)),
        "pos_inf": torch.where(torch.rand(width, generator=g) < 0.2, float("inf"), torch.randn(width, generator=g)),
        "low_bits": 1 + torch.randint(0, 16, (width,), generator=g).float() * 2.0 ** -16,  # one 16-bit prefix
        "threshold_tie": torch.cat((torch.arange(k // 4).float() + 10, torch.ones(width - k // 4))),
        "all_neg_inf": torch.full((width,), float("-inf")),
    }
    logits = torch.stack(list(rows.values()))
    lengths = torch.full((len(rows),), width, dtype=torch.int32)
    starts = torch.zeros(len(rows), dtype=torch.int32)
    tail = list(rows).index("garbage_tail")
    lengths[tail], starts[tail] = width - 40, 5
    logits[tail, width - 35:] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30] * 9)[:35]
    tie = list(rows).index("threshold_tie")
    logits[tie] = logits[tie][torch.randperm(width, generator=g)]
    return logits, lengths, starts


@pytest.mark.parametrize("max_chunks", [None, 1, 2], ids=["regions-default", "regions-1", "regions-2"])
def test_adversarial_rows_are_exact_as_positions_and_slots(max_chunks):
    """Every adversarial row, with the launcher's regions per row and with fewer (``max_chunks``)."""
    g = torch.Generator().manual_seed(0)
    width, k, p = 501, 40, 16
    logits, lengths, starts = adversarial_rows(width, k, g)
    r = logits.shape[0]
    small = SMALL if max_chunks is None else dict(SMALL, max_chunks=max_chunks)
    pos = torch.full((r, k), POISON, dtype=torch.int32)
    topk_triton(logits, lengths, k, starts, out=pos, **small)
    check_topk(pos, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
    table = torch.randperm(40 * r, generator=g)[:29 * r].view(r, 29).to(torch.int32)  # 29 * 16 < 501
    row_to_req = torch.arange(r, dtype=torch.int32).flip(0)
    seq_lens = torch.full((r,), width, dtype=torch.int32)
    out = torch.full((r, k), POISON, dtype=torch.int32)
    topk_triton(logits, lengths, k, starts, (table, row_to_req, seq_lens, p), out=out, **small)
    assert torch.equal(out, positions_to_slots_reference(pos, table, row_to_req, seq_lens, p))


@pytest.mark.parametrize("k", [32, 57], ids=lambda k: f"k{k}")
def test_edge_lengths_and_starts(k):
    """Lengths 0, 1, k-1, k, k+1, the full row, lengths clipped by the row end, starts past the end."""
    g = torch.Generator().manual_seed(k)
    width = 389
    lengths = torch.tensor([0, 1, k - 1, k, k + 1, width, width, 300, 200, 90], dtype=torch.int32)
    starts = torch.tensor([0, 3, 7, 0, 11, 0, 50, 250, width + 5, 299], dtype=torch.int32)
    logits = torch.randn(len(lengths), width, generator=g)
    logits[::3] = (logits[::3] * 4).round()  # ties at the threshold
    out = torch.full((len(lengths), k), POISON, dtype=torch.int32)
    topk_triton(logits, lengths, k, starts, out=out, **SMALL)
    check_topk(out, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))


def test_rows_narrower_than_k_take_one_pass():
    logits = torch.randn(5, 20)
    lengths = torch.tensor([20, 0, 7, 25, 19], dtype=torch.int32)
    out = torch.full((5, 24), POISON, dtype=torch.int32)
    topk_triton(logits, lengths, 24, None, out=out, **SMALL)
    assert torch.equal(out, topk_indices_reference(logits, lengths, 24))


def test_public_ops_run_triton_and_slots_match_positions():
    """``backend="triton"`` runs the kernels (default tiling); ``topk_slots`` writes the same selection
    as slots, -1 past ``seq_lens``, past the block table and for padding."""
    g = torch.Generator().manual_seed(3)
    width, k, p = 3000, 48, 16
    logits = (torch.randn(4, width, generator=g) * 8).round()
    lengths = torch.tensor([3000, 2500, 40, 2990], dtype=torch.int32)
    starts = torch.tensor([0, 100, 9, 10], dtype=torch.int32)
    pos = K.topk_indices(logits, lengths, k, starts, backend="triton")
    check_topk(pos, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
    table = torch.randperm(600, generator=g)[:3 * 150].view(3, 150).to(torch.int32)
    table = table[:, :140]  # positions >= 140 * 16 = 2240 fall outside the table
    row_to_req = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor([2400, 30, 2300], dtype=torch.int32)  # request 1: 30 < its row's 40 positions
    slots = K.topk_slots(logits, lengths, k, table, row_to_req, seq_lens, p, starts, backend="triton")
    assert torch.equal(slots, positions_to_slots_reference(pos, table, row_to_req, seq_lens, p))
    assert (slots == -1).sum() > (pos == -1).sum()  # the edges above were reached


def _tied_row(width, k, kind, g):
    """A row whose k-th largest value is tied with many others."""
    if kind == "relu_zeros":  # the indexer's ReLU: most logits exactly 0, a few positive
        return torch.where(torch.rand(width, generator=g) < k / (2 * width), torch.rand(width, generator=g), 0.0)
    if kind == "fp8_values":  # few distinct values, as e4m3 products give
        return torch.randn(width, generator=g).to(torch.float8_e4m3fn).float().clamp(-1, 1).round()
    # NaN mixed in: +NaN and -NaN patterns, infinities, and a tied plateau at the threshold
    row = torch.where(torch.rand(width, generator=g) < 0.5, 2.0, torch.randn(width, generator=g).clamp(-1, 1))
    bits = row.view(torch.int32)
    bits[torch.rand(width, generator=g) < 0.05] = 0x7FC00000  # +NaN: ranks above +inf
    bits[torch.rand(width, generator=g) < 0.05] = -4194304  # 0xFFC00000, -NaN: ranks below -inf
    row[torch.rand(width, generator=g) < 0.02] = float("inf")
    return row


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["relu_zeros", "fp8_values", "nan_mixed"])
def test_tied_row_selects_the_same_set_at_any_padding_and_batch(kind, backend):
    """The row's selection is a function of its window alone: padded by 0, 1, 28 or 157 columns of
    anything, shifted by ``starts``, batched with wider rows; the same positions on both backends."""
    g = torch.Generator().manual_seed(len(kind))
    width, k = 203, 32
    row = _tied_row(width, k, kind, g)
    alone = K.topk_indices_reference(row[None], torch.tensor([width], dtype=torch.int32), k)[0]
    expect = alone.sort().values
    for pad in (0, 1, 28, 157):
        shifts = (0, 9)
        logits = torch.randn(3, 9 + width + pad, generator=g)  # row 2, a wider row of the batch
        lengths = torch.tensor([width, width, 9 + width + pad], dtype=torch.int32)
        starts = torch.tensor([*shifts, 0], dtype=torch.int32)
        for r, shift in enumerate(shifts):
            logits[r, :shift] = float("nan")  # whatever lies before the window
            logits[r, shift:shift + width] = row
            logits[r, shift + width:] = float("inf")  # and after it: never selected, it is outside
        if backend == "triton":
            out = topk_triton(logits, lengths, k, starts, **SMALL)
        else:
            out = K.topk_indices(logits, lengths, k, starts, backend="torch")
        for r, shift in enumerate(shifts):
            assert torch.equal(out[r].sort().values, expect), f"pad {pad}, start {shift}: the selection moved"


def test_ties_go_to_the_lowest_positions():
    logits = torch.zeros(2, 100)
    logits[0, 50:] = 1.0  # 50 ones, k = 60: the ones and the first 10 zeros
    logits[1] = float("nan")  # +NaN everywhere: equal bit patterns tie; the first k positions
    lengths = torch.tensor([100, 100], dtype=torch.int32)
    want = [list(range(10)) + list(range(50, 100)), list(range(60))]
    for out in (K.topk_indices_reference(logits, lengths, 60), topk_triton(logits, lengths, 60, None, **SMALL)):
        assert [sorted(r) for r in out.tolist()] == want


def _sampled_columns(n, sample, seg=4):
    """The columns the Triton kernel's guess reads in a window of ``n`` (runs of ``seg`` spread evenly)."""
    i = torch.arange(sample)
    return torch.minimum((i // seg) * n // (sample // seg) + i % seg, torch.tensor(n - 1)).unique()


def test_every_path_is_exact():
    """Rows built against the guess reach each path of the kernel, and each stays exact: a sample
    that overstates the row (fewer than k columns reach the guess: the whole row is listed, in
    registers and in steps), a k-th value far above the sampled band (the clamped top bin), a
    constant row (regions too full for one tile; a long list refined in steps), ordinary rows."""
    g = torch.Generator().manual_seed(11)
    width, k, sample = 601, 40, 16
    rows, lengths = [], []
    for n in (width, 300):  # the sample overstates the row
        row = torch.randn(width, generator=g)
        row[_sampled_columns(n, sample)] = 100 + torch.arange(len(_sampled_columns(n, sample))).float()
        rows.append(row)
        lengths.append(n)
    far = 1 + torch.rand(width, generator=g) * 0.1  # 60 unsampled columns far above the sampled band
    free = torch.ones(width, dtype=torch.bool)
    free[_sampled_columns(width, sample)] = False
    far[free.nonzero().flatten()[torch.randperm(int(free.sum()), generator=g)[:60]]] = 1e6 + torch.arange(60.0)
    rows += [far, torch.full((width,), 3.0), torch.randn(width, generator=g), torch.arange(width).float()]
    lengths += [width] * 4
    logits, lengths = torch.stack(rows), torch.tensor(lengths, dtype=torch.int32)
    scratch = {}
    out = topk_triton(logits, lengths, k, None, out=torch.full((len(rows), k), POISON, dtype=torch.int32),
                       scratch=scratch, sample=sample, **SMALL)
    check_topk(out, logits, lengths, k, ref=topk_indices_reference(logits, lengths, k))
    regions = scratch["hist"]  # [R, C, 256]
    hist = regions.sum(1)
    total = hist.sum(1)
    at_least = total[:, None] - hist.cumsum(1) + hist
    b = (at_least >= k).sum(1) - 1
    fronts = regions.gather(2, b.clamp_min(0)[:, None, None].expand(-1, regions.shape[1], 1))[..., 0]  # [R, C]
    assert torch.all(total[:2] < k), "the baited rows must fail the guess"
    assert b[2] == 255, "the far row's k-th value must lie in the clamped top bin"
    assert fronts[3].max() > scratch["tiles"][1] and fronts[3].sum() > 512, "the constant row must take the slow paths"
    assert torch.all(total[4:] >= k) and torch.all(b[4:] < 255), "ordinary rows take the fast path"


@pytest.mark.parametrize("k,max_width,max_rows", [(2048, 70000, 300), (64, 9000, 7), (512, 530, 1),
                                                  (2048, 1 << 20, 1)], ids=["v32", "small", "one-row", "one-row-1m"])
def test_finish_tile_shapes_cover_every_tile_the_launcher_picks(k, max_width, max_rows):
    """The warm-up launches one shape per finish tile: every (rows, width) the launcher can meet
    picks a tile in that set (so no tile compiles after warm-up)."""
    from dsa.kernels.topk import finish_tile_shapes
    from dsa.kernels.topk.launch import SAMPLE, row_regions
    from dsa.kernels.topk.regions import finish_tiles
    shapes = finish_tile_shapes(k, max_width, max_rows)
    g = torch.Generator().manual_seed(k)
    widths = torch.randint(k + 1, max_width + 1, (300,), generator=g).tolist() + [k + 1, max_width]
    for width in widths:
        for r in {1, max_rows, int(torch.randint(1, max_rows + 1, (1,), generator=g))}:
            chunks = row_regions(r, width, k)
            tile = finish_tiles(k, width, SAMPLE, chunks)
            assert tile in shapes, (r, width, tile, sorted(shapes))
    for (fast, cb, w), (r, width) in shapes.items():  # each representative picks its own tile
        chunks = row_regions(r, width, k)
        assert finish_tiles(k, width, SAMPLE, chunks) == (fast, cb, w) and r <= max_rows and width <= max_width


def test_warm_topk_slots_launches_each_tile_once():
    from dsa.kernels.topk import finish_tile_shapes, warm_topk_slots
    assert warm_topk_slots(16, 300, 3, 16, "cpu") == len(finish_tile_shapes(16, 300, 3)) >= 1


def test_warm_topk_slots_compiles_the_tile_bound_when_rows_reach_it(monkeypatch):
    """Shapes that take the tile bound add its two variants (with and without starts) for each tile width
    they can take to the warm-up; a server whose steps never reach BOUND_ROWS rows adds none."""
    from dsa.kernels.topk import finish_tile_shapes, ops, warm_topk_slots
    from dsa.kernels.topk.launch import BOUND_ROWS, bound_widths
    seen = []
    monkeypatch.setattr(ops, "topk_slots", lambda logits, *a: seen.append((tuple(logits.shape), a[-1] is not None)))
    # the stub reads only the logits' shape: uninitialized logits of it, not randn (~6 s of CPU for 27 shapes, the
    # largest [264, 350464])
    monkeypatch.setattr(ops.torch, "randn", torch.empty)
    k, width, rows = 2048, 1 << 20, 8192
    tiles = bound_widths(k, width, rows)
    assert sorted(tiles) == [16, 32, 64]
    assert warm_topk_slots(k, width, rows, 16, "cpu") == len(finish_tile_shapes(k, width, rows)) + 2 * len(tiles)
    assert seen[-6:] == [(shape, st) for shape in tiles.values() for st in (False, True)]
    seen.clear()
    assert warm_topk_slots(k, width, BOUND_ROWS - 1, 16, "cpu") == len(finish_tile_shapes(k, width, BOUND_ROWS - 1))


@pytest.mark.parametrize("width,tile", [(1, 16), (1 << 17, 16), (1 << 18, 16), ((1 << 18) + 1, 32), (1 << 19, 32),
                                        ((1 << 19) + 1, 64), (1 << 20, 64), ((1 << 20) + 1, 128)],
                         ids=["1", "128K", "256K", "256K+1", "512K", "512K+1", "1M", "1M+1"])
def test_bound_tile_is_the_narrowest_that_fits_one_step_of_the_bound(width, tile):
    from dsa.kernels.topk.bound import TBLOCK
    from dsa.kernels.topk.launch import bound_tile
    assert bound_tile(width) == tile
    assert -(-width // tile) <= TBLOCK and (tile == 16 or -(-width // (tile // 2)) > TBLOCK)


@pytest.mark.parametrize("k,max_width,max_rows", [(2048, 1 << 20, 8192), (2048, 600000, 64), (2048, 200000, 8192),
                                                  (512, 1 << 16, 4096), (64, 40000, 300)],
                         ids=["1M", "600K-64rows", "200K", "k512-64K", "k64"])
def test_bound_widths_cover_every_tile_the_launcher_picks(k, max_width, max_rows):
    """Every bounded shape up to ``[max_rows, max_width]`` takes a tile width the warm-up launched (so no
    variant of the bound's kernels compiles later), and each representative takes its own."""
    from dsa.kernels.topk.launch import bound_tile, bound_widths, bounded
    shapes = bound_widths(k, max_width, max_rows)
    for tile, (r, width) in shapes.items():
        assert bound_tile(width) == tile and bounded(r, width, k) and r <= max_rows and width <= max_width
    g = np.random.default_rng(max_width)
    for width in np.unique(np.concatenate([g.integers(k + 1, max_width + 1, 400), [max_width]])):
        for r in {32, 64, 128, 409, max_rows}:
            if r <= max_rows and bounded(r, int(width), k):
                assert bound_tile(int(width)) in shapes, (r, int(width), sorted(shapes))


BOUNDED = dict(SMALL, bound_tiles=1, bound_rows=1, bound_elems=1, bound_bits=32, tile=8, tile_programs=40)


def _tile_bound(row, n, k, tile):
    """The torch statement of the bound: the k-th largest tile maximum of ``row[:n]`` (order keys)."""
    keys = order_key(row[:n])
    pad = (-n) % tile
    maxima = torch.cat((keys, keys.new_full((pad,), torch.iinfo(torch.int64).min))).view(-1, tile).max(1).values
    return maxima.sort(descending=True).values[k - 1], maxima


@pytest.mark.parametrize("slots", [False, True], ids=["positions", "slots"])
def test_tile_bound_is_exact_on_adversarial_rows(slots):
    """The tile bound's path (tile maxima, the bound, the scan of the listed tiles) selects the
    reference's set on every adversarial row, with starts, a clipped length and garbage past it, as
    positions and as slots; the same output as the sampled guess's path."""
    g = torch.Generator().manual_seed(5)
    width, k, p = 501, 40, 16
    logits, lengths, starts = adversarial_rows(width, k, g)
    r = logits.shape[0]
    table = torch.randperm(40 * r, generator=g)[:29 * r].view(r, 29).to(torch.int32)
    extra = (table, torch.arange(r, dtype=torch.int32).flip(0), torch.full((r,), width, dtype=torch.int32), p)
    extra = extra if slots else None
    bounded = torch.full((r, k), POISON, dtype=torch.int32)
    scratch = {}
    topk_triton(logits, lengths, k, starts, extra, out=bounded, scratch=scratch, **BOUNDED)
    assert "listed" in scratch, "the call must take the tile bound"
    guessed = topk_triton(logits, lengths, k, starts, extra, **SMALL)
    if slots:
        assert torch.equal(bounded.sort(1).values, guessed.sort(1).values)
    else:
        check_topk(bounded, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))
        assert torch.equal(bounded.sort(1).values, guessed.sort(1).values)


@pytest.mark.parametrize("n,k,tile", [(601, 7, 8), (1000, 40, 16), (333, 5, 64)], ids=["k7", "k40", "one-tile-k"])
def test_tile_bound_is_the_kth_tile_maximum_and_lists_its_tiles(n, k, tile):
    """``lo`` is exactly the k-th largest tile maximum of the window (not a looser key), the listed
    tiles are those reaching it, and on random rows they are far fewer than all tiles."""
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(3, n + 17, generator=g)
    lengths = torch.tensor([n, n - 1, n // 2 + k * tile], dtype=torch.int32).clamp_max(n)
    starts = torch.tensor([0, 17, 3], dtype=torch.int32)
    scratch = {}
    out = topk_triton(rows, lengths, k, starts, scratch=scratch, **dict(BOUNDED, tile=tile))
    check_topk(out, rows, lengths, k, starts, topk_indices_reference(rows, lengths, k, starts))
    for i in range(3):
        s, m = int(starts[i]), int(lengths[i])
        tau, maxima = _tile_bound(rows[i, s:], m, k, tile)
        lo = int(scratch["guess"][i, 0])
        assert lo == int(tau), (i, lo, int(tau))  # order keys and kernel keys are the same int32 order
        assert int(scratch["listed"][i]) == int((maxima >= tau).sum())
        if m // tile >= 4 * k:
            assert int(scratch["listed"][i]) < m // tile // 2, "random rows must leave most tiles out"


@pytest.mark.parametrize("bits", [1, 9, 16], ids=["sign", "exponent", "16-bits"])
def test_tile_bound_of_fewer_bits_is_lower_and_selects_the_same(bits):
    """``bound_bits`` finds only tau's top bits: ``lo`` is then a key at or below the k-th tile maximum, the
    listed tiles include those reaching it, and the selection (adversarial rows, starts) is the same."""
    g = torch.Generator().manual_seed(bits)
    width, k = 501, 40
    logits, lengths, starts = adversarial_rows(width, k, g)
    full, part = {}, {}
    want = topk_triton(logits, lengths, k, starts, scratch=full, **BOUNDED)
    got = topk_triton(logits, lengths, k, starts, scratch=part, **dict(BOUNDED, bound_bits=bits))
    assert torch.equal(got.sort(1).values, want.sort(1).values)
    assert bool((part["guess"][:, 0] <= full["guess"][:, 0]).all()) and bool((part["listed"] >= full["listed"]).all())
    check_topk(got, logits, lengths, k, starts, topk_indices_reference(logits, lengths, k, starts))


def test_tile_bound_falls_back_to_every_tile_when_the_tiles_hold_only_the_lowest_nan():
    """Fewer than k tiles holding anything above the lowest key (0xFFFFFFFF, a -NaN): the bound is
    INT_MIN, every tile is listed, and the selection stays exact."""
    width, k = 300, 12
    logits = torch.empty(2, width)
    logits.view(torch.int32)[:] = -1  # 0xFFFFFFFF: the lowest key
    logits[0, [5, 77, 140]] = 1.0  # 3 tiles hold something higher, fewer than k
    lengths = torch.tensor([width, width - 3], dtype=torch.int32)
    scratch = {}
    out = topk_triton(logits, lengths, k, None, scratch=scratch, **BOUNDED)
    check_topk(out, logits, lengths, k, None, topk_indices_reference(logits, lengths, k))
    assert scratch["guess"][:, 0].tolist() == [-2 ** 31] * 2
    assert scratch["listed"].tolist() == [-(-width // 8), -(-(width - 3) // 8)]


@pytest.mark.parametrize("rows,width,k,expect", [
    (128, 2048, 2048, False), (128, 4 * 2048 * 16 - 1, 2048, False), (128, 4 * 2048 * 16, 2048, True),
    (64, 4 * 2048 * 16, 2048, False), (409, 160000, 2048, True), (64, 1 << 19, 2048, True), (64, 1 << 20, 2048, True),
    (64, 1 << 20, 1 << 20, False), (31, 1 << 20, 2048, False), (32, 1 << 20, 2048, True)],
    ids=["dense", "below", "at", "decode-64x128K", "prefill-160K", "512K", "1M", "k-wide", "decode-rows", "32-rows"])
def test_bounded_routes_by_width_and_rows(rows, width, k, expect):
    from dsa.kernels.topk.launch import bounded
    assert bounded(rows, width, k) is expect
