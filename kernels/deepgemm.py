"""DeepGEMM's indexer logits as the explicit, optional ``backend="deepgemm"`` of ``indexer_logits_paged``
and ``indexer_logits_ragged``.

``deep_gemm`` (github.com/deepseek-ai/DeepGEMM) is no dependency: its PyPI name is an empty
placeholder, so it is built from source, as vLLM's users do. It runs only where a caller passes
``backend="deepgemm"``; ``"auto"`` never picks it. Its accumulation order differs from the Triton
kernels', so its logits are not theirs bit for bit (``tests/test_deepgemm_gpu.py`` asks for the same
``-inf`` masks and ``calc_diff < 1e-6``) and a top-k selection can differ where positions nearly tie.

Hopper (sm_90) limits, checked here before any call: ``HI`` in {32, 64}, ``DI`` in {32, 64, 128};
paged: ``P = 64``, ``N`` (its next_n) <= 2, a contiguous cache. The paged kernel needs a schedule
from ``get_paged_mqa_logits_metadata`` (one small launch per call, made here; vLLM makes it once
per step for all layers). Each kernel is compiled by nvcc on its first call (``CUDA_HOME``, a
writable ``DG_JIT_CACHE_DIR``): make one call before capturing a CUDA graph.

The paged kernel takes one context length per row (``[B, N]``) and then writes no ``-inf``: the
window ``[0, S_b - N + j]``, positions past the block table and blocks whose id is outside
``[0, NB)`` are masked here afterwards (block ids are clamped into range for the kernel), so the
result keeps ``indexer_logits_paged``'s contract. It reads the planar cache through a
``[NB, P, 1, DI + 4]`` view, only for its strides. Both results are views whose rows keep
DeepGEMM's aligned stride.

Build it so that it runs on the process's libstdc++ (``tests/test_deepgemm_gpu.py`` says why).
"""
import importlib.util

import torch


def available() -> bool:
    """Whether ``deep_gemm`` can be imported (nothing is imported)."""
    return importlib.util.find_spec("deep_gemm") is not None


def _require(op: str, device: torch.device, hi: int, di: int, paged: tuple[int, int] | None = None) -> None:
    """The package, then the kernels' limits (``paged``: ``(P, N)``), then the device."""
    if not available():
        raise ValueError(f"{op}: backend='deepgemm' needs the deep_gemm package, built from source "
                         "(github.com/deepseek-ai/DeepGEMM; its PyPI release is a placeholder)")
    if hi not in (32, 64) or di not in (32, 64, 128):
        raise ValueError(f"q8: DeepGEMM's Hopper kernels take HI in 32, 64 and DI in 32, 64, 128; got HI={hi}, DI={di}")
    if paged is not None and (paged[0] != 64 or paged[1] > 2):
        raise ValueError(f"{op}: DeepGEMM's Hopper paged kernel takes block_size 64 and N <= 2; got block_size "
                         f"{paged[0]}, N {paged[1]}")
    if device.type != "cuda":
        raise ValueError(f"{op}: backend='deepgemm' needs CUDA tensors, got tensors on {device}")


def logits_paged(q8, weights, index_cache, block_table, seq_lens, block_size, width):
    """``indexer_logits_paged`` (arguments validated there; ``width`` the output width W) through
    ``deep_gemm.fp8_paged_mqa_logits``: ``logits [B * N, W]`` float32."""
    b, n, hi, di = q8.shape
    _require("indexer_logits_paged", q8.device, hi, di, paged=(block_size, n))
    if not index_cache.is_contiguous():
        raise ValueError(f"index_cache: DeepGEMM reads a contiguous cache; got strides {index_cache.stride()}")
    nb, mb = index_cache.shape[0], block_table.shape[1]
    if b * n == 0 or width == 0 or nb == 0 or mb == 0:  # nothing to score: empty, or every position -inf
        return torch.full((b * n, width), float("-inf"), device=q8.device)
    import deep_gemm
    last = seq_lens.long()[:, None] - n + torch.arange(n, device=q8.device)  # [B, N] last visible position
    ctx = (last + 1).clamp(0, min(width, mb * block_size)).to(torch.int32)  # positions it scores per row
    ctx[:, -1].clamp_(min=1)  # >= 1 block per request: its schedule reads past its table when every length is 0
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, block_size, deep_gemm.get_num_sms())
    logits = deep_gemm.fp8_paged_mqa_logits(q8.contiguous(), index_cache.view(nb, block_size, 1, di + 4),
                                            weights.reshape(b * n, hi).contiguous(), ctx,
                                            block_table.clamp(0, nb - 1), meta, width, False)
    pos = torch.arange(width, device=q8.device)
    block_ok = (block_table >= 0) & (block_table < nb)
    ok = block_ok[:, (pos // block_size).clamp(max=mb - 1)] & (pos < mb * block_size)  # [B, W]
    keep = ok[:, None, :] & (pos <= last[:, :, None])  # [B, N, W]
    return logits.masked_fill_(~keep.view(b * n, width), float("-inf"))


def logits_ragged(q8, weights, k8, k_scale, starts, ends):
    """``indexer_logits_ragged`` (arguments validated there) through ``deep_gemm.fp8_mqa_logits``:
    ``logits [T, S]`` float32, ``-inf`` outside ``[starts[t], ends[t])`` (its clean pass)."""
    t, hi, di = q8.shape
    _require("indexer_logits_ragged", q8.device, hi, di)
    s = k8.shape[0]
    if t == 0 or s == 0:
        return torch.full((t, s), float("-inf"), device=q8.device)
    import deep_gemm
    starts = starts.clamp(0, s)
    ends = torch.maximum(ends.clamp(0, s), starts)  # an empty range: all -inf
    return deep_gemm.fp8_mqa_logits(q8.contiguous(), (k8.contiguous(), k_scale.contiguous()), weights.contiguous(),
                                    starts, ends, True)
