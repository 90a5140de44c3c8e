"""Choices between implementations of the SAME function (never which positions a query attends to).

Dense prefill rows take up-projected MHA (SDPA) or the absorbed kernel. (Decode rows have no
choice: with an indexer every decode row takes top-k + the sparse kernel, a short row being handed
every position, so that a row's kernel never depends on its batch and decode steps can be
captured in CUDA graphs; without an indexer they take the dense absorbed kernel.)

The threshold comes from a JSON file measured by ``python -m dsa bench crossover``
(``config.dispatch_thresholds`` names one; the H200 file under ``dsa/data/`` is the default on
Hopper); with none, the analytic FLOP rule below decides.
"""
import json
import os
from dataclasses import dataclass

import torch

from dsa.config import DSAConfig

PACKAGED = {(9, 0): os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "dispatch_h200.json")}


@dataclass(frozen=True)
class Dispatch:
    """``prefill_mha_min_query``: dense prefill uses MHA from this many query rows (None: the
    analytic rule). ``mha_workspace_bytes``: MHA only while the up-projected K/V fit."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
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
        # FLOPs per head: absorbed attention costs Q*S*(2R + Dr) for the scores and values, MHA costs the
        # up-projection of S latent rows S*R*(Dn+Dv) plus Q*S*(Dn+Dr+Dv); absorbed wins while
        # Q*R*(Dn+Dv)/S + Q*(2R - Dn - Dv) < R*(Dn+Dv) (Q ~ 171 for V3.2 at long S)
        absorbed = queries * r * (dn + dv) / context + queries * (2 * r - dn - dv) < r * (dn + dv)
        return not absorbed


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
        return Dispatch(**base, prefill_mha_min_query=data["prefill_mha_min_query"], source=os.path.basename(path))
    except KeyError as e:
        raise ValueError(f"dispatch_thresholds: {path} lacks the key {e}") from None
