"""greedy_accept: a verify step's greedy acceptance of speculative decoding in one launch.

Row ``b`` holds ``N`` draft tokens (``-1`` past its own) and the target's argmax after each of its ``N + 1``
rows: it accepts the longest prefix of drafts equal to the argmax and then emits the argmax of the row after
them, so its tokens are the argmax up to and including the row of its first mismatch (its accepted drafts
equal the argmax there), ``-1`` after. The argmax over the vocabulary is the caller's (one torch op); this op
is the rest (the compare, the prefix count, the tokens), without a host sync.
"""
import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, check_same_device, check_tensor, resolve_backend

BLOCK_ROWS = 64  # rows a program


def greedy_accept_reference(argmax, drafts):
    n1 = argmax.shape[1]
    target = argmax.long()
    agree = (target[:, :n1 - 1] == drafts) & (drafts >= 0)  # [B, N]
    accepted = agree.long().cumprod(dim=-1).sum(dim=-1)  # [B]: the leading agreeing drafts
    cols = torch.arange(n1, device=argmax.device)
    return torch.where(cols[None, :] <= accepted[:, None], target, -1), accepted


@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["argmax_ptr", "drafts_ptr"])
def _greedy_accept_kernel(argmax_ptr, drafts_ptr, tokens_ptr, accepted_ptr, num_rows, stride_ab, stride_aj,
                          stride_db, stride_dj, N: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``BLOCK`` rows, each its ``N + 1`` columns (``COLS``: a power of two above ``N``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] int64
    cols = tl.arange(0, COLS)
    in_rows = rows[:, None] < num_rows
    target = tl.load(argmax_ptr + rows[:, None] * stride_ab + cols[None, :] * stride_aj,
                     mask=in_rows & (cols[None, :] <= N), other=0).to(tl.int64)  # [BLOCK, COLS]
    draft = tl.load(drafts_ptr + rows[:, None] * stride_db + cols[None, :] * stride_dj,
                    mask=in_rows & (cols[None, :] < N), other=-1).to(tl.int64)
    miss = (target != draft) | (draft < 0) | (cols[None, :] >= N)  # column N and past it: no draft, a miss
    accepted = tl.min(tl.where(miss, cols[None, :], COLS), axis=1).to(tl.int64)  # [BLOCK] in [0, N]
    tokens = tl.where(cols[None, :] <= accepted[:, None], target, -1)
    tl.store(tokens_ptr + rows[:, None] * (N + 1) + cols[None, :], tokens, mask=in_rows & (cols[None, :] <= N))
    tl.store(accepted_ptr + rows, accepted, mask=rows < num_rows)


def _greedy_accept_triton(argmax, drafts):
    b, n1 = argmax.shape
    tokens = torch.empty((b, n1), dtype=torch.int64, device=argmax.device)
    accepted = torch.empty(b, dtype=torch.int64, device=argmax.device)
    if b == 0:
        return tokens, accepted
    # one variant per N (and the strides it fixes): the row count changes per step (a runtime value), and the
    # inputs may be views of a step's packed buffer at any offset
    _greedy_accept_kernel[(triton.cdiv(b, BLOCK_ROWS),)](
        argmax, drafts, tokens, accepted, b, argmax.stride(0), argmax.stride(1), drafts.stride(0), drafts.stride(1),
        N=n1 - 1, COLS=triton.next_power_of_2(n1), BLOCK=BLOCK_ROWS, num_warps=1)
    return tokens, accepted


def greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, *, backend: str = "auto") -> tuple:
    """The greedy acceptance of ``B`` rows of ``N`` drafts (module docstring).

    Args:
        argmax: ``[B, N + 1]`` int64/int32, the target's argmax token at each of a row's ``N + 1`` verify
            rows (row ``j``: after its draft ``j``; row 0 after its last token); ``N >= 1``.
        drafts: ``[B, N]`` int64/int32 draft tokens, ``-1`` (any negative) past a row's drafts: never
            accepted, nor any draft after it.

    Returns:
        ``(tokens [B, N + 1] int64, accepted [B] int64)``: ``accepted[b]`` in ``[0, N]``, the leading drafts
        equal to the argmax; ``tokens[b, :accepted[b] + 1]`` the argmax there (the accepted drafts, then the
        token after them), ``-1`` after. The Triton kernel (one launch, 64 rows a program) gives the
        reference's tensors. B = 0 gives empty outputs.
    """
    check_tensor("argmax", argmax, dtype=INDEX_DTYPES, shape=2)
    b, n1 = argmax.shape
    if n1 < 2:
        raise ValueError(f"argmax: expected [B, N + 1] with N >= 1, got {list(argmax.shape)}")
    check_tensor("drafts", drafts, dtype=INDEX_DTYPES, shape=(b, n1 - 1))
    device = check_same_device(argmax=argmax, drafts=drafts)
    if resolve_backend(backend, device, "greedy_accept") == "torch":
        return greedy_accept_reference(argmax, drafts)
    return _greedy_accept_triton(argmax, drafts)
