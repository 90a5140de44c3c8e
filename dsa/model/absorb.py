"""Weight absorption for MLA: split ``kv_b_proj`` into the folded query and output weights."""
import torch


def absorb_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``(W_UK_T [H, D_NOPE, R], W_UV [H, R, D_V])`` from ``kv_b_proj.weight``.

    Args:
        kv_b_weight: ``[H * (D_NOPE + D_V), R]``, per head the rows ``[W_UK; W_UV]`` (HF layout).

    The absorbed query is ``[q_nope @ W_UK_T | q_pe]`` ``[T, H, R + D_R]``; the attention output
    ``[T, H, R]`` in latent space becomes ``out @ W_UV`` ``[T, H, D_V]``.
    """
    if not isinstance(kv_b_weight, torch.Tensor) or kv_b_weight.dim() != 2:
        raise TypeError(f"kv_b_weight: expected a 2-D tensor, got {getattr(kv_b_weight, 'shape', type(kv_b_weight))}")
    rows, rank = kv_b_weight.shape
    if rows != num_heads * (qk_nope_head_dim + v_head_dim):
        raise ValueError(f"kv_b_weight: expected {num_heads * (qk_nope_head_dim + v_head_dim)} rows "
                         f"(H={num_heads} x ({qk_nope_head_dim} + {v_head_dim})), got {rows}")
    w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, rank)
    w_uk, w_uv = w.split([qk_nope_head_dim, v_head_dim], dim=1)  # [H, D_NOPE, R], [H, D_V, R]
    return w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()
