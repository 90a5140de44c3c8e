"""pick_ids: each row's token id from the first of up to three sources that has one, in one launch.

Speculative decoding reads ids on the device that the host does not know yet: a verify step's draft rows read
their drafts (the rows' packed ids elsewhere), and the MTP module's rows read the token after each row (an
emitted token, else the next row's id, else a host-known id). Row ``i`` takes ``tokens[index[i]]`` when that
names a token, else ``ids[ids_index[i]]`` when that names an entry, else ``default[i]``; no host sync.
"""
import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, check_same_device, check_tensor, resolve_backend

BLOCK_ROWS = 128  # rows a program


def _take(source, index):
    """``(has [T] bool, values [T] int64)``: ``source[index]`` where ``index`` is in ``[0, len(source))``."""
    at = index.long()
    has = (at >= 0) & (at < source.shape[0])
    if source.shape[0] == 0:
        return has, torch.zeros(at.shape, dtype=torch.int64, device=at.device)
    return has, source.long()[torch.where(has, at, 0)]


def pick_ids_reference(default, tokens, index, ids=None, ids_index=None, out=None):
    value = default.long()
    if ids is not None:
        has, found = _take(ids, ids_index)
        value = torch.where(has, found, value)
    has, token = _take(tokens, index)
    value = torch.where(has & (token >= 0), token, value)
    if out is None:
        return value
    return out.copy_(value)


@triton.jit(do_not_specialize=["num_rows", "num_tokens", "num_ids"],
            do_not_specialize_on_alignment=["default_ptr", "tokens_ptr", "index_ptr", "ids_ptr", "ids_index_ptr",
                                            "out_ptr"])
def _pick_ids_kernel(default_ptr, tokens_ptr, index_ptr, ids_ptr, ids_index_ptr, out_ptr, num_rows, num_tokens,
                     num_ids, stride_default, stride_tokens, stride_index, stride_ids, stride_ids_index, stride_out,
                     HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``BLOCK`` rows; each reads its default, then (``HAS_IDS``) its ids entry, then its token."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] int64
    in_rows = rows < num_rows
    value = tl.load(default_ptr + rows * stride_default, mask=in_rows, other=0).to(tl.int64)
    if HAS_IDS:
        j = tl.load(ids_index_ptr + rows * stride_ids_index, mask=in_rows, other=-1).to(tl.int64)
        has = in_rows & (j >= 0) & (j < num_ids)
        value = tl.where(has, tl.load(ids_ptr + j * stride_ids, mask=has, other=0).to(tl.int64), value)
    i = tl.load(index_ptr + rows * stride_index, mask=in_rows, other=-1).to(tl.int64)
    has = in_rows & (i >= 0) & (i < num_tokens)
    token = tl.load(tokens_ptr + i * stride_tokens, mask=has, other=-1).to(tl.int64)
    value = tl.where(has & (token >= 0), token, value)
    tl.store(out_ptr + rows * stride_out, value.to(out_ptr.dtype.element_ty), mask=in_rows)


def _pick_ids_triton(default, tokens, index, ids, ids_index, out):
    t = default.shape[0]
    if out is None:
        out = torch.empty(t, dtype=torch.int64, device=default.device)
    if t == 0:
        return out
    has_ids = ids is not None
    ids, ids_index = (ids, ids_index) if has_ids else (index, index)  # (unread without ids)
    # one variant per HAS_IDS and the dtypes (and unit strides, fixed by the layouts): the row and source
    # lengths change per step (runtime values), and every input may be a view of a packed buffer at any offset
    _pick_ids_kernel[(triton.cdiv(t, BLOCK_ROWS),)](
        default, tokens, index, ids, ids_index, out, t, tokens.shape[0], ids.shape[0], default.stride(0),
        tokens.stride(0), index.stride(0), ids.stride(0), ids_index.stride(0), out.stride(0), HAS_IDS=has_ids,
        BLOCK=BLOCK_ROWS, num_warps=4)
    return out


def _check(default, tokens, index, ids, ids_index, out) -> torch.device:
    check_tensor("default", default, dtype=INDEX_DTYPES, shape=1)
    t = default.shape[0]
    check_tensor("tokens", tokens, dtype=INDEX_DTYPES, shape=1)
    check_tensor("index", index, dtype=INDEX_DTYPES, shape=(t,))
    if (ids is None) != (ids_index is None):
        raise ValueError("ids: give ids and ids_index together, or neither")
    if ids is not None:
        check_tensor("ids", ids, dtype=INDEX_DTYPES, shape=1)
        check_tensor("ids_index", ids_index, dtype=INDEX_DTYPES, shape=(t,))
    if out is not None:
        check_tensor("out", out, dtype=INDEX_DTYPES, shape=(t,))
    return check_same_device(default=default, tokens=tokens, index=index, ids=ids, ids_index=ids_index, out=out)


def pick_ids(default: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor, ids: torch.Tensor | None = None,
             ids_index: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
    """Each row's id from the first source that has one (module docstring).

    Args:
        default: ``[T]`` int32/int64, each row's id when no other source has one.
        tokens: ``[M]`` int32/int64, e.g. a flat view of ``[S, N]`` drafts or ``[S, N + 1]`` emitted tokens;
            ``-1`` (any negative) holds no token.
        index: ``[T]`` int32/int64, each row's entry of ``tokens``; ``-1`` (any negative, or ``>= M``): none.
        ids: None, or ``[K]`` int32/int64, the second source (e.g. a step's packed ids).
        ids_index: with ``ids``, ``[T]`` int32/int64, each row's entry of ``ids``; ``-1`` (any negative, or
            ``>= K``): none.
        out: ``[T]`` int32/int64 to write (``default`` itself: in place), or None: a new int64 tensor. It
            must not overlap ``tokens``, ``index``, ``ids`` or ``ids_index``.

    Returns:
        ``out``: row ``i`` is ``tokens[index[i]]`` where ``index[i]`` names an entry of ``tokens`` holding a
        token (``>= 0``); else ``ids[ids_index[i]]`` where ``ids_index[i]`` names an entry of ``ids``; else
        ``default[i]`` (cast to ``out``'s dtype). The Triton kernel (one launch, 128 rows a program) gives the
        reference's values. T = 0 gives an empty output.
    """
    device = _check(default, tokens, index, ids, ids_index, out)
    if resolve_backend(backend, device, "pick_ids") == "torch":
        return pick_ids_reference(default, tokens, index, ids, ids_index, out)
    return _pick_ids_triton(default, tokens, index, ids, ids_index, out)
