"""dense_mla_decode: absorbed MLA decode rows over every visible position of their paged context.

The Triton kernel is the one of ``sparse_mla`` with ``DENSE=True``: the ``N * H`` query rows of a
request form one group, key rows come from its block table, split along the context for small grids.
A block id outside ``[0, NB)`` makes its positions invisible (never read), on every backend, without a
host sync.
"""
import torch

from .common import FLOAT_DTYPES, check_real, check_same_device, check_tensor, resolve_backend
from .layouts import KV_LORA_RANK, LATENT_DIM, latent_cache_format
from .slots import positions_to_slots_reference
from .sparse_mla import mla_attention_triton, sparse_mla_reference


def dense_mla_decode_reference(q, latent_cache, block_table, seq_lens, softmax_scale):
    b, n, h, d = q.shape
    block_size = latent_cache.shape[1]
    # positions past the block table map to no slot: the width never needs to exceed MB * P
    width = min(max(0, int(seq_lens.max())), block_table.shape[1] * block_size) if b else 0
    pos = torch.arange(width, dtype=torch.int32, device=q.device)
    last = (seq_lens[:, None] - n + torch.arange(n, device=q.device)).reshape(b * n)  # last visible position
    positions = torch.where(pos[None, :] <= last[:, None], pos[None, :], -1).to(torch.int32)  # [B*N, W]
    row_to_req = torch.arange(b, dtype=torch.int32, device=q.device).repeat_interleave(n)
    slots = positions_to_slots_reference(positions, block_table, row_to_req, seq_lens, block_size)
    out, lse = sparse_mla_reference(q.reshape(b * n, h, d), latent_cache, slots, softmax_scale)
    return out.view(b, n, h, KV_LORA_RANK), lse.view(b, n, h)


def dense_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     softmax_scale: float, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of decode rows over their whole visible context.

    Args:
        q: ``[B, N, H, 576]`` bfloat16 absorbed queries (float32/float64 through the reference).
        latent_cache: bfloat16 ``[NB, P, 576]``, uint8 ``[NB, P, 656]`` or float32 ``[NB, P, 576]``.
        block_table: ``[B, MB]`` int32; an id outside ``[0, NB)`` is no block: its positions are not
            attended (never read).
        seq_lens: ``[B]`` int32, ``S`` of each request (its ``N`` new tokens included); any value
            (positions past the block table are not attended).
        softmax_scale: multiplies ``q . k``.

    Returns:
        ``(out [B, N, H, 512] q.dtype, lse [B, N, H] float32)``: query ``j`` of request ``b``
        attends positions ``[0, S_b - N + j]`` of its own blocks; no visible position gives
        ``out = 0``, ``lse = -inf``. B, N or H = 0 give empty outputs of these shapes.
    """
    fmt = latent_cache_format(latent_cache)
    softmax_scale = check_real("softmax_scale", softmax_scale)
    check_tensor("q", q, dtype=FLOAT_DTYPES, shape=(None, None, None, LATENT_DIM))
    b = q.shape[0]
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(b, None))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(b,))
    device = check_same_device(q=q, latent_cache=latent_cache, block_table=block_table, seq_lens=seq_lens)
    impl = resolve_backend(backend, device, "dense_mla_decode", triton_dtypes_ok=fmt != "fp32" and q.dtype == torch.bfloat16,
                           block_size=latent_cache.shape[1])
    if impl == "torch":
        return dense_mla_decode_reference(q, latent_cache, block_table, seq_lens, float(softmax_scale))
    if latent_cache.stride(2) != 1:
        raise ValueError("latent_cache: expected unit stride along the row (a contiguous last dim)")
    n, h = q.shape[1], q.shape[2]
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    # one program group per request over its N * H query rows; the context bound MB * P needs no host sync
    out, lse = mla_attention_triton(q.contiguous().view(b * n * h, LATENT_DIM), latent_cache, n * h, b,
                                    block_table=block_table, seq_lens=seq_lens, n=n, h=h,
                                    length=block_table.shape[1] * latent_cache.shape[1], softmax_scale=softmax_scale)
    return out.view(b, n, h, KV_LORA_RANK), lse.view(b, n, h)
