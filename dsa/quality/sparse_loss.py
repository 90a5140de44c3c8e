"""Held-out loss of a teacher whose every layer attends only to a top-k selection (DeepSeek's parity claim, small).

For each ``k`` and each selection rule, one full forward pass where each query row attends to its
``k`` selected positions (rows whose past fits in ``k`` attend densely):

- ``dense``: the teacher as it is;
- ``oracle``: the true top-k of the layer's own head-averaged attention (the best any shared selection can do);
- ``fitted every f``: the fitted indexers' FP8 selection, computed on the sparse model's own hidden states; a
  layer that the skip pattern ``f`` leaves without an indexer reuses the nearest earlier one's selection.

The loss is reported over all next-token predictions of the window and over its second half (where
every query at 8K sees more than 2048 positions).
"""
import torch

from dsa.quality.selection import indexer_logits, oracle, reuse_source, select, sink_recent
from dsa.quality.teacher import attention_probs


def _means(per_token: torch.Tensor) -> dict:
    half = per_token.shape[0] // 2
    return {"all": float(per_token.mean()), "second_half": float(per_token[half:].mean())}


def oracle_rule(k: int, chunk: int):
    def rule(i, x, q, kk):
        rows = torch.arange(q.shape[0], device=q.device)
        return oracle(attention_probs(q, kk, rows, chunk=chunk), rows, k)
    return rule


def sink_recent_rule(k: int):
    """Tokens 0-3 and the last ``k - 4`` positions of each row (its whole past when that fits in ``k``)."""
    def rule(i, x, q, kk):
        rows = torch.arange(q.shape[0], device=q.device)
        sel = sink_recent(rows, k)
        return sel.masked_fill(sel > rows[:, None], -1)  # sink positions past an early row
    return rule


def fitted_rule(indexers_fp8: dict, every: int, k: int, cos, sin, num_layers: int):
    source = reuse_source(list(indexers_fp8), every, num_layers)
    last = {}

    def rule(i, x, q, kk):
        if i not in source:
            return None
        if source[i] == i:
            rows = torch.arange(x.shape[0], device=x.device)
            last["sel"] = select(indexer_logits(indexers_fp8[i], x, rows, cos, sin, "fp8"), rows, k)
        return last["sel"]
    return rule


def sparse_losses(teacher, windows: list, indexers_fp8: dict, ks: list, patterns: list, cos, sin,
                  progress=None) -> dict:
    """``{"dense": {...}, "by_k": [{"k", "oracle", "fitted": {f: {...}}}]}``, each loss a dict
    ``{"all", "second_half"}`` of nats/token averaged over ``windows``."""
    chunk = 512 if teacher.device.type == "cuda" else 64

    def mean_loss(select_rule):
        out = [_means(teacher.loss(ids, select=select_rule)) for ids in windows]
        if progress is not None:
            progress.update(1)
        return {key: sum(o[key] for o in out) / len(out) for key in out[0]}

    result = {"dense": mean_loss(None), "by_k": []}
    for k in ks:
        row = {"k": k, "oracle": mean_loss(oracle_rule(k, chunk)), "fitted": {}}
        for f in patterns:
            row["fitted"][str(f)] = mean_loss(fitted_rule(indexers_fp8, f, k, cos, sin, teacher.config.num_layers))
        result["by_k"].append(row)
    return result
