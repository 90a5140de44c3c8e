"""indexer_logits_ragged: prefill-row indexer logits against contiguous keys, per-row [start, end)."""
import torch

from .common import check_same_device, check_tensor, compute_dtype, resolve_backend


def indexer_logits_ragged_reference(q8, weights, k8, k_scale, starts, ends):
    t, hi, di = q8.shape
    s = k8.shape[0]
    dt = compute_dtype(q8, weights, k8 if k8.is_floating_point() else None)
    k = k8.to(dt)  # [S, DI]
    cols = torch.arange(s, device=q8.device)
    logits = torch.empty((t, s), dtype=torch.float32, device=q8.device)
    chunk = max(1, (1 << 24) // max(1, hi * s))  # bounds the [chunk, HI, S] temporary
    for t0 in range(0, t, chunk):
        q = q8[t0:t0 + chunk].to(dt)  # [C, HI, DI]
        score = torch.einsum("ch,chs->cs", weights[t0:t0 + chunk].to(dt), torch.relu(torch.einsum("chd,sd->chs", q, k)))
        if k_scale is not None:
            score = score * k_scale.to(dt)
        inside = (cols >= starts[t0:t0 + chunk, None]) & (cols < ends[t0:t0 + chunk, None])
        logits[t0:t0 + chunk] = torch.where(inside, score, float("-inf")).float()
    return logits


def indexer_logits_ragged(q8: torch.Tensor, weights: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor | None,
                          starts: torch.Tensor, ends: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Indexer logits of prefill rows against ``S`` contiguous keys.

    Args:
        q8: ``[T, HI, DI]`` float8_e4m3fn (or a float dtype for exact precision, reference only).
        weights: ``[T, HI]`` float32 head weights (query scales folded in).
        k8: ``[S, DI]`` float8_e4m3fn keys (from ``gather_indexer_keys``), or float for exact.
        k_scale: ``[S]`` float32 key scales; ``None`` only with float (exact) keys.
        starts, ends: ``[T]`` int32, row ``t`` scores columns ``[starts[t], ends[t])``.

    Returns:
        ``logits [T, S]`` float32, ``sum_h weights[t, h] * relu(q8[t, h] . k8[s]) * k_scale[s]``
        inside each row's range and ``-inf`` outside. The caller bounds ``T * S`` by chunking.
    """
    check_tensor("q8", q8, shape=3)
    t, hi, di = q8.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(t, hi))
    exact = k8.is_floating_point() and k8.dtype != torch.float8_e4m3fn
    check_tensor("k8", k8, shape=(None, di))
    if exact:
        check_tensor("q8", q8, dtype=(torch.bfloat16, torch.float32, torch.float64))
        if k_scale is not None:
            check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    else:
        check_tensor("q8", q8, dtype=torch.float8_e4m3fn)
        check_tensor("k8", k8, dtype=torch.float8_e4m3fn)
        check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(k8.shape[0],))
    check_tensor("starts", starts, dtype=torch.int32, shape=(t,))
    check_tensor("ends", ends, dtype=torch.int32, shape=(t,))
    device = check_same_device(q8=q8, weights=weights, k8=k8, k_scale=k_scale, starts=starts, ends=ends)
    impl = resolve_backend(backend, device, "indexer_logits_ragged", kernel_ready=False, issue=3,
                           triton_dtypes_ok=not exact)
    if impl == "torch":
        return indexer_logits_ragged_reference(q8, weights, k8, k_scale, starts, ends)
