"""Choices between implementations of the SAME function (never which positions a query attends to).

- decode rows whose whole context fits in ``index_topk``: the dense absorbed kernel, or the sparse
  kernel handed every position;
- dense prefill rows: up-projected MHA (SDPA) or the absorbed kernel.

Thresholds come from a JSON file measured by ``python -m dsa bench crossover``
(``config.dispatch_thresholds`` names one; the H200 file under ``dsa/data/`` is the default on
Hopper); with none, the seed's analytic FLOP rule decides prefill and decode uses the dense kernel.
"""
import json
import os
from dataclasses import dataclass

import torch

from .config import DSAConfig

PACKAGED = {(9, 0): os.path.join(os.path.dirname(__file__), "data", "dispatch_h200.json")}


@dataclass(frozen=True)
class Dispatch:
    """``decode_sparse_max_len``: decode rows with ``S <=`` this use the sparse kernel with every
    position (0: never). ``prefill_mha_min_query``: dense prefill uses MHA from this many query rows
    (None: the analytic rule). ``mha_workspace_bytes``: MHA only while the up-projected K/V fit."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    decode_sparse_max_len: int = 0
    prefill_mha_min_query: int | None = None
    mha_workspace_bytes: int = 256 << 20
    source: str = "analytic"

    def prefill_uses_mha(self, queries: int, context: int, kv_bytes: int) -> bool:
        """MHA for ``queries`` dense prefill rows over ``context`` positions (``kv_bytes`` of up-projected K/V)?"""
        if kv_bytes > self.mha_workspace_bytes:
            return False
        if self.prefill_mha_min_query is not None:
            return queries >= self.prefill_mha_min_query
        r, dn, dv = self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        # seed's rule: absorbed iff Q*R*(Dn+Dv)/S + Q*(2R - Dn - Dv) < R*(Dn+Dv)
        absorbed = queries * r * (dn + dv) / context + queries * (2 * r - dn - dv) < r * (dn + dv)
        return not absorbed

    def decode_uses_sparse_kernel(self, seq_len: int) -> bool:
        return seq_len <= self.decode_sparse_max_len


def load_dispatch(config: DSAConfig, device: torch.device, mha_workspace_bytes: int = 256 << 20) -> Dispatch:
    """The thresholds ``config.dispatch_thresholds`` names, else the packaged file for this GPU, else analytic."""
    base = dict(kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                v_head_dim=config.v_head_dim, mha_workspace_bytes=mha_workspace_bytes)
    path = config.dispatch_thresholds
    if path is None and device.type == "cuda":
        path = PACKAGED.get(torch.cuda.get_device_capability(device))
        if path is not None and not os.path.exists(path):
            path = None
    if path is None:
        return Dispatch(**base)
    with open(path) as f:
        data = json.load(f)
    try:
        return Dispatch(**base, decode_sparse_max_len=int(data["decode_sparse_max_len"]),
                        prefill_mha_min_query=data["prefill_mha_min_query"], source=os.path.basename(path))
    except KeyError as e:
        raise ValueError(f"dispatch_thresholds: {path} lacks the key {e}") from None
