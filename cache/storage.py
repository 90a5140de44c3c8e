"""Paged cache storage objects and the calls that write and read them through ``dsa.kernels``.

Ids follow the kernels' rule: a slot outside ``[0, NB * P)`` writes nothing, and a position whose
block id is outside ``[0, NB)`` reads nothing.
"""
import torch

from dsa.kernels import indexer_key_write, latent_write, positions_to_slots
from dsa.kernels.common import check_block_size, check_int, check_tensor
from dsa.kernels.layouts import INDEXER_HEAD_DIM, LATENT_ROWS, indexer_bytes_per_token, indexer_cache_views

LATENT_FORMATS = tuple(LATENT_ROWS)  # "bf16", "fp8", "fp32"


class IndexerKeyCache:
    """One layer's indexer keys.

    ``precision="fp8"``: ``.data`` is ``uint8 [num_blocks, P * 132]``, planar per block.
    ``precision="exact"``: ``.data`` is ``[num_blocks, P, DI]`` in ``dtype`` (unquantized keys,
    scored by the references only).
    """

    def __init__(self, num_blocks: int, block_size: int, precision: str = "fp8", dtype: torch.dtype | None = None,
                 device=None, head_dim: int = INDEXER_HEAD_DIM):
        num_blocks = check_int("num_blocks", num_blocks, minimum=0)
        self.block_size = check_block_size(block_size)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.precision = precision
        if precision == "fp8":
            if dtype not in (None, torch.uint8):
                raise ValueError(f"dtype: an fp8 indexer cache is uint8, got {dtype}")
            self.data = torch.zeros(num_blocks, block_size * indexer_bytes_per_token(head_dim), dtype=torch.uint8,
                                    device=device)
        elif precision == "exact":
            self.data = torch.zeros(num_blocks, block_size, head_dim, dtype=dtype or torch.bfloat16, device=device)
        else:
            raise ValueError(f"precision: expected 'fp8' or 'exact', got {precision!r}")

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def bytes_per_token(self) -> int:
        return self.data[0].numel() * self.data.element_size() // self.block_size


class LatentCache:
    """One layer's latent rows ``[kv_c | k_pe]``: ``"bf16"`` ``[NB, P, 576]``, ``"fp8"``
    ``uint8 [NB, P, 656]`` (FlashMLA layout) or ``"fp32"`` ``[NB, P, 576]``."""

    def __init__(self, num_blocks: int, block_size: int, format: str = "bf16", device=None):
        num_blocks = check_int("num_blocks", num_blocks, minimum=0)
        self.block_size = check_block_size(block_size)
        if format not in LATENT_FORMATS:
            raise ValueError(f"format: expected one of {LATENT_FORMATS}, got {format!r}")
        self.format = format
        width, dtype = LATENT_ROWS[format]
        self.data = torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def bytes_per_token(self) -> int:
        return self.data.shape[-1] * self.data.element_size()


def write_indexer_keys(cache: IndexerKeyCache, k: torch.Tensor, slot_mapping: torch.Tensor,
                       hadamard: bool = False) -> None:
    """Store keys ``k [T, DI]`` at ``slot_mapping [T]`` (int32/int64; slots outside ``[0, NB * P)`` skipped).

    FP8 caches quantize (after the Hadamard transform when asked); exact caches store ``k``
    as it is and take no Hadamard.
    """
    if not isinstance(cache, IndexerKeyCache):
        raise TypeError(f"cache: expected an IndexerKeyCache, got {type(cache).__name__}")
    if cache.precision == "fp8":
        indexer_key_write(cache.data, k, slot_mapping, cache.block_size, hadamard)
        return
    if hadamard:
        raise ValueError("hadamard: exact-precision indexer caches keep keys without the Hadamard transform")
    check_tensor("k", k, shape=(None, cache.head_dim), device=cache.data.device)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(k.shape[0],),
                 device=cache.data.device)
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < cache.num_blocks * cache.block_size)
    cache.data[slots[keep] // cache.block_size, slots[keep] % cache.block_size] = k[keep].to(cache.data.dtype)


def write_latent(cache: LatentCache, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``[kv_c (512) | k_pe (64)]`` rows at ``slot_mapping [T]`` (outside ``[0, NB * P)`` skipped)."""
    if not isinstance(cache, LatentCache):
        raise TypeError(f"cache: expected a LatentCache, got {type(cache).__name__}")
    latent_write(cache.data, kv_c, k_pe, slot_mapping)


def gather_indexer_keys(cache: IndexerKeyCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        total: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each request's keys, positions ``0 .. S_b - 1``, concatenated in request order.

    Args:
        block_table: ``[B, MB]`` int32, at least ``ceil(S_b / P)`` blocks per request (else
            ``ValueError``; with ``total`` given the caller vouches for it); a block id outside
            ``[0, NB)`` is read as no block.
        seq_lens: ``[B]`` int32; negative counts as 0.
        total: ``sum(S_b)`` when the caller knows it (a step plan does): nothing is read back from
            the device. None: a host sync sizes the output.

    Returns:
        FP8: ``(k8 [sum(S), DI] float8_e4m3fn, k_scale [sum(S)] float32)``;
        exact: ``(k [sum(S), DI] cache dtype, None)``. Positions in a block whose id is outside
        ``[0, NB)`` read nothing: their keys and scales are 0 (they score 0, and no slot maps
        them, so attention never reads them). B = 0 gives ``[0, DI]`` and ``[0]``.
    """
    if not isinstance(cache, IndexerKeyCache):
        raise TypeError(f"cache: expected an IndexerKeyCache, got {type(cache).__name__}")
    check_tensor("block_table", block_table, dtype=torch.int32, shape=2, device=cache.data.device)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],), device=cache.data.device)
    lengths = seq_lens.long().clamp_min(0)
    if total is None:
        if (lengths > block_table.shape[1] * cache.block_size).any():  # before sizing anything by seq_lens
            raise ValueError(f"block_table: too few blocks ({block_table.shape[1]}) for seq_lens")
        total = int(lengths.sum())
    total = check_int("total", total, minimum=0)
    row_to_req = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                         output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = (torch.arange(total, device=lengths.device) - starts[row_to_req]).to(torch.int32)
    slots = positions_to_slots(positions[:, None], block_table, row_to_req.to(torch.int32), seq_lens,
                               cache.block_size)[:, 0].long()
    ok = (slots >= 0) & (slots < cache.num_blocks * cache.block_size)  # block ids outside [0, NB): nothing read
    slots = torch.where(ok, slots, 0)
    block, offset = slots // cache.block_size, slots % cache.block_size
    if cache.precision == "exact":
        data = cache.data if cache.num_blocks else cache.data.new_zeros(1, cache.block_size, cache.head_dim)
        return data[block, offset].masked_fill(~ok[:, None], 0), None
    k8, scale = indexer_cache_views(cache.data, cache.block_size)
    if not cache.num_blocks:
        k8, scale = k8.new_zeros(1, cache.block_size, cache.head_dim), scale.new_zeros(1, cache.block_size)
    k = k8[block, offset].view(torch.uint8).masked_fill(~ok[:, None], 0).view(torch.float8_e4m3fn)
    return k, scale[block, offset].masked_fill(~ok, 0)

