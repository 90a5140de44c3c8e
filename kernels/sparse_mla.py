"""sparse_mla: absorbed MLA over selected rows of the shared 576-wide latent cache."""
import torch

from .common import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype, resolve_backend
from .layouts import KV_LORA_RANK, LATENT_DIM, LATENT_FP8_TILE, latent_cache_format, latent_fp8_views


def gather_latent_rows(latent_cache, slots, dtype):
    """Rows ``[..., 576]`` of the cache at ``slots`` (all >= 0), dequantized to ``dtype``."""
    block_size = latent_cache.shape[1]
    block, offset = slots // block_size, slots % block_size
    if latent_cache_format(latent_cache) != "fp8":
        return latent_cache[block, offset].to(dtype)
    kv8, scale, k_pe = latent_fp8_views(latent_cache)
    kv = kv8[block, offset].to(dtype).unflatten(-1, (-1, LATENT_FP8_TILE)) * scale[block, offset].to(dtype)[..., None]
    return torch.cat((kv.flatten(-2), k_pe[block, offset].to(dtype)), dim=-1)


def sparse_mla_reference(q, latent_cache, slots, softmax_scale):
    t, h, _ = q.shape
    dt = compute_dtype(q)
    out = torch.empty((t, h, KV_LORA_RANK), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float64 if dt == torch.float64 else torch.float32, device=q.device)
    k = slots.shape[1]
    chunk = max(1, (1 << 24) // max(1, k * LATENT_DIM))  # bounds the gathered [chunk, K, 576] rows
    for t0 in range(0, t, chunk):
        sl = slots[t0:t0 + chunk].long()  # [C, K]
        valid = sl >= 0
        rows = gather_latent_rows(latent_cache, sl.clamp_min(0), dt)  # [C, K, 576]
        rows = torch.where(valid[..., None], rows, 0)  # rows no slot names never reach the math
        score = torch.einsum("chd,ckd->chk", q[t0:t0 + chunk].to(dt), rows) * softmax_scale
        score = torch.where(valid[:, None, :], score, float("-inf"))
        row_lse = torch.logsumexp(score, dim=-1)  # [C, H], -inf for rows with no valid slot
        p = torch.exp(score - torch.where(torch.isfinite(row_lse), row_lse, 0)[..., None])
        out[t0:t0 + chunk] = torch.einsum("chk,ckd->chd", p, rows[..., :KV_LORA_RANK]).to(q.dtype)
        lse[t0:t0 + chunk] = row_lse.to(lse.dtype)
    return out, lse


def sparse_mla(q: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor, softmax_scale: float, *,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends, in the absorbed 576-wide space, to the cache rows its slots name.

    Args:
        q: ``[T, H, 576]`` bfloat16 absorbed queries ``[q_nope @ W_UK_T | q_pe]``
            (float32/float64 through the reference).
        latent_cache: bfloat16 ``[NB, P, 576]``, uint8 ``[NB, P, 656]`` (FP8) or float32
            ``[NB, P, 576]`` (reference only). K is the whole row, V its first 512 values.
        slots: ``[T, K]`` int32 cache slots, ``-1`` skipped.
        softmax_scale: multiplies ``q . k`` before the softmax.

    Returns:
        ``(out [T, H, 512] q.dtype, lse [T, H] float32)`` with natural-log ``lse``; a row with
        no valid slot gives ``out = 0`` and ``lse = -inf``.
    """
    fmt = latent_cache_format(latent_cache)
    check_tensor("q", q, dtype=FLOAT_DTYPES, shape=(None, None, LATENT_DIM))
    check_tensor("slots", slots, dtype=torch.int32, shape=(q.shape[0], None))
    device = check_same_device(q=q, latent_cache=latent_cache, slots=slots)
    impl = resolve_backend(backend, device, "sparse_mla", kernel_ready=False, issue=5,
                           triton_dtypes_ok=fmt != "fp32" and q.dtype == torch.bfloat16)
    if impl == "torch":
        return sparse_mla_reference(q, latent_cache, slots, float(softmax_scale))
