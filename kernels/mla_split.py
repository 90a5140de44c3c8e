"""mla_split: the launch machinery both MLA kernels share.

The portable Triton kernel (``sparse_mla._mla_attn_kernel``) and the Hopper Gluon kernel
(``sparse_mla_hopper._mla_hopper_kernel``) take the same arguments in the same order and split one
query row's keys over programs the same way when the grid is smaller than the GPU. What they share
lives here: the outputs, the number of splits, the per-split partial outputs and log2-domain LSEs,
the argument list, and the kernel that merges the splits by LSE. Both launchers import this module;
neither imports the other's internals (``sparse_mla`` and ``dense_mla_decode`` import
``sparse_mla_hopper`` only to route a call to it).
"""
import torch
import triton
import triton.language as tl

from .common import sm_count
from .layouts import KV_LORA_RANK, latent_cache_format

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # programs one query row's keys are split over (the combine kernel reads them at once)


@triton.jit(do_not_specialize=["TOTAL_ROWS", "NUM_SPLITS"])
def _mla_combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, TOTAL_ROWS, NUM_SPLITS,
                        BLOCK_S: tl.constexpr):
    """Merge the splits of one query row by their log2-domain LSE: out bf16 [512], lse natural log."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(part_lse_ptr + s.to(tl.int64) * TOTAL_ROWS + row, mask=s < NUM_SPLITS,
                    other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_use)  # 0 for empty splits
    w_sum = tl.sum(w, 0)
    d = tl.arange(0, 512)
    acc = tl.zeros([512], tl.float32)
    for i in range(0, NUM_SPLITS):
        w_i = tl.exp2(tl.load(part_lse_ptr + i * TOTAL_ROWS + row) - m_use)
        o_i = tl.load(part_out_ptr + (i * TOTAL_ROWS + row) * 512 + d)
        acc += o_i * w_i
    empty = w_sum == 0.0
    tl.store(out_ptr + row * 512 + d, (acc / tl.where(empty, 1.0, w_sum)).to(tl.bfloat16))
    tl.store(lse_ptr + row, tl.where(empty, float("-inf"), (m_use + tl.log2(tl.where(empty, 1.0, w_sum))) * 0.6931471805599453))


def choose_splits(device: torch.device, programs: int, tiles: int, granule: int, splits: int | None = None):
    """``(splits, tiles a split)`` for a grid of ``programs`` programs a split over ``tiles`` key tiles.

    Without ``splits``: enough splits to fill the SMs once (``sm_count // programs``), at most
    :data:`MAX_SPLITS` and at most half the tiles (two tiles a split at least). A split's tiles are
    then rounded up to a multiple of ``granule`` and the count taken again (the last split may be
    shorter; none is empty). The two kernels differ only in ``granule``: the portable kernel's splits
    are whole tiles (1), the Hopper kernel's whole pairs of tiles (2: its two consumer warpgroups take
    one tile of a pair each).
    """
    if splits is None:
        splits = max(1, min(sm_count(device) // programs, triton.cdiv(tiles, 2), MAX_SPLITS))
    split_tiles = max(granule, granule * triton.cdiv(triton.cdiv(tiles, splits), granule))
    return max(1, triton.cdiv(tiles, split_tiles)), split_tiles


class SplitLaunch:
    """One MLA launch over ``groups x rows`` query rows (see :func:`split_launch`): ``out`` / ``lse``,
    ``grid`` (None for no rows), ``args`` (the kernels' runtime arguments, in their order) and
    ``flags`` (the constexprs DENSE, FP8, SPLIT). :meth:`finish` merges the splits."""

    def __init__(self, out, lse, grid=None, args=(), flags=None, splits=1, part=None):
        self.out, self.lse, self.grid, self.args, self.flags = out, lse, grid, args, flags or {}
        self.splits, self.part = splits, part

    def finish(self):
        """Merge the splits (one combine launch; nothing without splits): ``(out, lse)``."""
        if self.splits > 1:
            part_out, part_lse = self.part
            total = self.out.shape[0]
            # its two ints are runtime values: one variant
            _mla_combine_kernel[(total,)](part_out, part_lse, self.out, self.lse, total, self.splits,
                                          BLOCK_S=MAX_SPLITS, num_warps=4)
        return self.out, self.lse


def split_launch(q_rows, latent_cache, rows, groups, *, row_blocks, block_n, granule, split_in_keys, slots=None,
                 block_table=None, seq_lens=None, n=1, h=None, length, softmax_scale, splits=None) -> SplitLaunch:
    """The outputs, splits, partial buffers and arguments of one MLA launch.

    Query rows ``q_rows [groups * rows, 576]`` bf16, ``row_blocks`` programs a group (of ``rows``
    rows), keys in tiles of ``block_n``. Sparse (``slots [groups, K]``): a group is a token, ``rows``
    its ``H`` heads. Dense (``block_table``/``seq_lens``): a group is a request, ``rows = N * H``,
    ``length`` an upper bound of its context. ``granule`` and ``splits``: :func:`choose_splits`.
    ``split_in_keys``: the split length argument counts keys (the portable kernel's ``SPLIT_LEN``)
    rather than tiles (the Hopper kernel's ``SPLIT_TILES``).
    """
    device = q_rows.device
    total = groups * rows
    out = torch.empty((total, KV_LORA_RANK), dtype=torch.bfloat16, device=device)
    lse = torch.empty((total,), dtype=torch.float32, device=device)
    if total == 0:
        return SplitLaunch(out, lse)
    splits, split_tiles = choose_splits(device, groups * row_blocks, triton.cdiv(length, block_n), granule, splits)
    if splits > 1:
        part_out = torch.empty((splits, total, KV_LORA_RANK), dtype=torch.float32, device=device)
        part_lse = torch.empty((splits, total), dtype=torch.float32, device=device)
    else:
        part_out, part_lse = out, lse  # unused
    dense = slots is None
    if dense:
        slots_arg, stride_slots, k = block_table, 0, 0
        bt_arg, sl_arg, stride_bt, mb = block_table, seq_lens, block_table.stride(0), block_table.shape[1]
    else:
        slots_arg, stride_slots, k = slots, slots.stride(0), slots.shape[1]
        bt_arg, sl_arg, stride_bt, mb = slots, slots, 0, 0
        h = rows
    nb, block_size = latent_cache.shape[0], latent_cache.shape[1]
    args = (q_rows, latent_cache, slots_arg, bt_arg, sl_arg, out, lse, part_out, part_lse,
            float(softmax_scale) * LOG2E, rows, h, n, k, mb, nb, nb * block_size, total,
            split_tiles * block_n if split_in_keys else split_tiles,
            stride_slots, stride_bt, latent_cache.stride(0), latent_cache.stride(1), block_size)
    flags = dict(DENSE=dense, FP8=latent_cache_format(latent_cache) == "fp8", SPLIT=splits > 1)
    return SplitLaunch(out, lse, (groups, row_blocks, splits), args, flags, splits, (part_out, part_lse))
