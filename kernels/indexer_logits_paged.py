"""indexer_logits_paged: decode-row indexer logits over the paged FP8 key cache."""
import torch

from .common import check_block_size, check_same_device, check_tensor, compute_dtype, resolve_backend
from .layouts import INDEXER_SCALE_BYTES, indexer_cache_views


def _paged_keys(index_cache, block_table_row, positions, block_size, dtype):
    """Keys and scales of one request at ``positions`` (all inside its block table)."""
    blocks = block_table_row.long()[positions // block_size]
    offsets = positions % block_size
    if index_cache.dtype == torch.uint8:  # FP8 planar cache
        k8, scale = indexer_cache_views(index_cache, block_size)
        return k8[blocks, offsets].to(dtype), scale[blocks, offsets].to(dtype)
    return index_cache[blocks, offsets].to(dtype), None  # exact cache [NB, P, DI]


def indexer_logits_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size, max_seq_len=None):
    b, n, hi, di = q8.shape
    width = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    dt = compute_dtype(q8, weights, index_cache if index_cache.is_floating_point() else None)
    logits = torch.full((b * n, width), float("-inf"), dtype=torch.float32, device=q8.device)
    lengths = seq_lens.tolist()
    chunk = max(1, (1 << 24) // max(1, n * hi))  # bounds the [N, HI, chunk] temporaries
    for r in range(b):
        # causal: query j of request r sees positions [0, S_r - N + j]
        visible = min(lengths[r], width, block_table.shape[1] * block_size)
        q = q8[r].to(dt)  # [N, HI, DI]
        w = weights[r].to(dt)  # [N, HI]
        for s0 in range(0, visible, chunk):
            pos = torch.arange(s0, min(visible, s0 + chunk), device=q8.device)
            k, k_scale = _paged_keys(index_cache, block_table[r], pos, block_size, dt)  # [C, DI], [C]
            score = torch.einsum("nh,nhc->nc", w, torch.relu(torch.einsum("nhd,cd->nhc", q, k)))
            if k_scale is not None:
                score = score * k_scale
            last = lengths[r] - n + torch.arange(n, device=q8.device)  # [N] last visible position
            score = torch.where(pos[None, :] <= last[:, None], score, float("-inf"))
            logits[r * n:(r + 1) * n, s0:s0 + len(pos)] = score.float()
    return logits


def indexer_logits_paged(q8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         max_seq_len: int | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Indexer logits of decode rows against each request's paged keys.

    Args:
        q8: ``[B, N, HI, DI]`` float8_e4m3fn queries (from ``indexer_query_prep``); for an
            exact-precision cache, the unquantized queries in a float dtype.
        weights: ``[B, N, HI]`` float32, the head weights with the query scales folded in.
        index_cache: ``uint8 [NB, P * (DI + 4)]`` planar FP8 cache, or an exact cache
            ``[NB, P, DI]`` (bfloat16/float32/float64, reference only).
        block_table: ``[B, MB]`` int32, block ids of each request's positions.
        seq_lens: ``[B]`` int32, ``S`` of each request (its new ``N`` tokens included).
        block_size: ``P``.
        max_seq_len: output width ``W``; ``int(seq_lens.max())`` when None (a host sync).

    Returns:
        ``logits [B * N, W]`` float32: row ``b * N + j`` holds
        ``sum_h weights[h] * relu(q8[h] . k8[s]) * k_scale[s]`` on ``[0, seq_lens[b] - N + j]``
        and ``-inf`` elsewhere (also past the block table).
    """
    check_tensor("q8", q8, shape=4)
    b, n, hi, di = q8.shape
    block_size = check_block_size(block_size)
    check_tensor("weights", weights, dtype=torch.float32, shape=(b, n, hi))
    exact = index_cache.is_floating_point()
    if exact:
        check_tensor("index_cache", index_cache, shape=(None, block_size, di))
        check_tensor("q8", q8, dtype=(torch.bfloat16, torch.float32, torch.float64))
    else:
        check_tensor("index_cache", index_cache, dtype=torch.uint8,
                     shape=(None, block_size * (di + INDEXER_SCALE_BYTES)))
        check_tensor("q8", q8, dtype=torch.float8_e4m3fn)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(b, None))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(b,))
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len: expected None or a non-negative int, got {max_seq_len!r}")
    device = check_same_device(q8=q8, weights=weights, index_cache=index_cache, block_table=block_table,
                               seq_lens=seq_lens)
    impl = resolve_backend(backend, device, "indexer_logits_paged", kernel_ready=False, issue=3,
                           triton_dtypes_ok=not exact, block_size=block_size)
    if impl == "torch":
        return indexer_logits_paged_reference(q8, weights, index_cache, block_table, seq_lens, block_size,
                                              max_seq_len)
