"""Keys, digits and the guess from a sample: where a row's k-th value very likely lies.

Keys: :func:`key_of` the fp32 bits, an int32 whose signed order is
:func:`~dsa.kernels.topk.reference.order_key`'s (NaN by its bits). A row's guess is ``(lo, shift)``:
a key ``lo`` that, very likely, at least k columns of the row reach, and a bin width ``2**shift``
that cuts the sample's band around the k-th value into fewer than 64 bins.
"""
import triton
import triton.language as tl

SEG = 4  # the sample is read in runs of SEG columns
Z = 5.0  # guess margin, in standard deviations of the sample count above the k-th value
INT_MIN = tl.constexpr(-2147483648)  # the lowest key


@triton.jit
def key_of(x):
    """fp32 -> int32 whose signed order is ``order_key``'s (NaN by its bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def pick_digit(h, rem):
    """Digit of the ``rem``-th largest entry from a histogram ``h [256]`` of the entries left.

    Returns ``(d, rem')``: that entry's digit and how many of those still to be found have digit
    ``d`` (``rem`` minus the entries with a digit above ``d``).
    """
    bins = tl.arange(0, 256)
    at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # [256] entries with digit >= bin
    d = tl.minimum(tl.maximum(tl.sum((at_least >= rem).to(tl.int32), 0) - 1, 0), 255)
    return d, rem - tl.sum(tl.where(bins > d, h, 0), 0)


@triton.jit
def _guess_from_sample(u, n, k, SAMPLE: tl.constexpr, Z: tl.constexpr):
    """``(lo, shift)`` from a sample's keys ``u [SAMPLE]`` (``key_of ^ INT_MIN``: bits in unsigned
    order) of a row of ``n`` columns: ``lo`` the 16-bit prefix floor of the sample's
    ``m + Z sqrt(m) + 2``-th largest (``m = k * SAMPLE / n``, the sample's expected count at or above
    the row's k-th value), or INT_MIN when that exceeds the sample; ``shift`` such that the sample's
    band down from its ``m - Z sqrt(m)``-th largest to ``lo`` spans fewer than 64 bins."""
    m = k * 1.0 * SAMPLE / n.to(tl.float32)  # k * 1.0: k may arrive as a constexpr (Triton specializes 1)
    spread = Z * tl.sqrt(m)
    m_lo = (m + spread).to(tl.int32) + 2
    m_hi = tl.maximum((m - spread).to(tl.int32), 1)
    top = (u >> 24) & 255
    mid = (u >> 16) & 255
    h = tl.histogram(top, 256)
    a_lo, r_lo = pick_digit(h, tl.minimum(m_lo, SAMPLE))
    a_hi, r_hi = pick_digit(h, m_hi)
    h_lo = tl.histogram(mid, 256, mask=top == a_lo)
    b_lo, _r = pick_digit(h_lo, r_lo)
    h_hi = h_lo
    if a_hi != a_lo:
        h_hi = tl.histogram(mid, 256, mask=top == a_hi)
    b_hi, _r = pick_digit(h_hi, r_hi)
    lo = ((a_lo << 24) | (b_lo << 16)) ^ INT_MIN
    lo = tl.where(m_lo > SAMPLE, INT_MIN, lo)
    hi = ((a_hi << 24) | (b_hi << 16) | 65535) ^ INT_MIN
    span = (hi.to(tl.int64) - lo.to(tl.int64)).to(tl.float32)  # >= 0; its exponent: floor(log2)
    shift = tl.maximum((span.to(tl.int32, bitcast=True) >> 23) - 127 - 5, 0)
    return lo, shift


@triton.jit
def guess_row(row_l, n, k, SAMPLE: tl.constexpr, SEG: tl.constexpr, Z: tl.constexpr):
    """``(lo, shift)`` of a logits row of ``n`` columns at ``row_l`` (see ``_guess_from_sample``)."""
    i = tl.arange(0, SAMPLE)
    pos = tl.minimum((i // SEG).to(tl.int64) * n // (SAMPLE // SEG) + i % SEG, n - 1)
    u = key_of(tl.load(row_l + pos)) ^ INT_MIN
    return _guess_from_sample(u, n, k, SAMPLE, Z)
