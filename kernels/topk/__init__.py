"""topk_indices and topk_slots: the best ``k`` columns of each row, as positions or as cache slots.

Selection rule, the same on every backend (the torch reference and the Triton kernel), for any row
width, padding, ``starts`` and batch composition:

- order: fp32 values by their bits (``reference.order_key``): +NaN above +inf, -NaN below -inf,
  -0.0 below +0.0; equal bit patterns (NaN ones included) tie like any value;
- ties: among values equal to the k-th largest, the lowest positions are selected.

So a row's selection is a function of that row's valid window alone: it does not change with how
far the row is padded, with the other rows of the batch, or with the device.

Modules: ``ops`` (the checked ops and the warm-up), ``reference`` (the torch reference),
``launch`` (the scheme, its kernels and their launcher), ``bound`` (the tile bound of wide rows:
their tile maxima and the k-th largest of them) and the kernels' device functions: ``guess`` (keys
and the guess from a sample), ``regions`` (rows, candidate regions and their bins), ``select`` (the
exact selection from a list).
"""
from .launch import finish_tile_shapes
from .ops import topk_indices, topk_slots, warm_topk_slots
from .reference import topk_indices_reference, topk_slots_reference
