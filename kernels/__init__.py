"""DSA kernels: byte layouts, torch references and Triton kernels, one file per op.

Each op ``<op>`` validates shapes, dtypes and devices, then runs Triton on CUDA tensors and
its ``<op>_reference`` twin (pure torch, any device) otherwise; ``backend="torch"|"triton"|"auto"``
overrides. This package imports nothing else of ``dsa``.

Rules every op keeps on both backends, without a host sync: ids outside their range (a slot outside
``[0, NB * P)``, a block id outside ``[0, NB)``, a ``row_to_req`` outside ``[0, B)``, a position outside
its table) read and write nothing and contribute nothing, as each docstring details; empty inputs give
empty outputs of the documented shapes; NaN/inf encode in FP8 as ``layouts`` says. Python ints are
checked by ``common.check_int`` (no bools, floats or tensors), numbers by ``common.check_real``.
"""
from .dense_mla_decode import dense_mla_decode, dense_mla_decode_reference
from .greedy_accept import greedy_accept, greedy_accept_reference
from .indexer_key_write import indexer_key_write, indexer_key_write_reference
from .indexer_logits_paged import indexer_logits_paged, indexer_logits_paged_reference
from .indexer_logits_ragged import indexer_logits_ragged, indexer_logits_ragged_reference
from .indexer_query_prep import indexer_query_prep, indexer_query_prep_reference
from .latent_write import latent_write, latent_write_reference
from .pick_ids import pick_ids, pick_ids_reference
from .quant import hadamard, hadamard_reference, quant_ue8m0, quant_ue8m0_reference
from .rms_norm import rms_norm, rms_norm_reference
from .rope import (
    apply_rope,
    apply_rope_reference,
    rope_at,
    rope_at_reference,
    rope_rotate,
    rope_rotate_reference,
    yarn_cos_sin,
    yarn_mscale,
)
from .silu_mul import silu_mul, silu_mul_reference
from .slots import positions_to_slots, positions_to_slots_reference
from .sparse_mla import sparse_mla, sparse_mla_reference
from .topk import topk_indices, topk_indices_reference, topk_slots, topk_slots_reference

__all__ = [
    "apply_rope", "apply_rope_reference", "dense_mla_decode", "dense_mla_decode_reference", "greedy_accept",
    "greedy_accept_reference", "hadamard", "hadamard_reference", "indexer_key_write", "indexer_key_write_reference",
    "indexer_logits_paged", "indexer_logits_paged_reference", "indexer_logits_ragged",
    "indexer_logits_ragged_reference", "indexer_query_prep", "indexer_query_prep_reference", "latent_write",
    "latent_write_reference", "pick_ids", "pick_ids_reference", "positions_to_slots",
    "positions_to_slots_reference", "quant_ue8m0", "quant_ue8m0_reference", "rms_norm", "rms_norm_reference",
    "rope_at", "rope_at_reference", "rope_rotate", "rope_rotate_reference", "silu_mul", "silu_mul_reference",
    "sparse_mla", "sparse_mla_reference", "topk_indices", "topk_indices_reference", "topk_slots",
    "topk_slots_reference", "yarn_cos_sin", "yarn_mscale",
]
