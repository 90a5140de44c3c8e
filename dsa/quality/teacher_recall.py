"""How much of a pretrained model's attention fitted lightning indexers select: the scoring behind
``dsa recall --teacher`` (:mod:`dsa.commands.recall_teacher`; its sequences are
:mod:`dsa.quality.sequences`, its tables and figures :mod:`dsa.quality.teacher_report`).

On held-out text, for every layer and every ``k``, the share of the layer's true attention (averaged over
heads) that falls on

    fitted_fp8    the fitted indexer's selection through the deployed FP8 path (132-byte cache, our kernels)
    fitted_exact  the same indexer in exact precision
    oracle        the true top-k of that attention (the most any k positions can hold)
    sink_recent   tokens 0-3 and the last k - 4 (StreamingLLM's rule)
    untrained     a freshly initialized indexer (FP8)

over query positions whose past exceeds ``k`` (others attend densely and are left out), with and
without token 0 (``no_sink``: the share of the attention on positions >= 1). Beside them: FP8-vs-exact
top-k agreement; the mass kept by the skip patterns (a layer without its own indexer reuses the nearest
earlier one's selection, every 1/2/4 layers); exact-target hits (the source of a copied random-token
span, the digits of a pass key hidden in prose: is the position the query must copy from selected);
optionally (``--sparse-loss``) the teacher's loss with every layer restricted to the selections.
"""
from collections import defaultdict

import torch
from tqdm import tqdm

from dsa.indexer import LightningIndexer
from dsa.quality.fit import sample_queries
from dsa.quality.selection import (
    agreement,
    hits,
    indexer_config,
    indexer_logits,
    mass,
    oracle,
    reuse_source,
    rope_tables,
    select,
    sink_recent,
)
from dsa.quality.teacher import attention_probs

METHODS = ("fitted_fp8", "fitted_exact", "oracle", "sink_recent", "untrained")
PATTERNS = (1, 2, 4)


# ---- accumulation -------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.sum, self.n = defaultdict(float), defaultdict(int)

    def add(self, key, values: torch.Tensor):
        self.sum[key] += float(values.float().sum())
        self.n[key] += values.numel()

    def mean(self, key):
        return self.sum[key] / self.n[key] if self.n.get(key) else None


def score(teacher, ids, queries, ks, ev, tally: Tally, targets=None, kind="prose") -> None:
    """One sequence through the teacher; every layer's selections scored into ``tally``.

    ``ev``: ``fitted_fp8`` / ``fitted_exact`` / ``untrained`` ``{layer: indexer}``, ``sources``
    ``{pattern: {layer: source layer}}``, ``layers`` (reported), ``cos``, ``sin``.
    """
    queries = queries.to(teacher.device)
    targets = None if targets is None else targets.to(teacher.device)
    fp8_logits = {}
    t = ids.numel()

    def observe(i, x, q, k):
        if i in ev["fitted_fp8"]:
            fp8_logits[i] = indexer_logits(ev["fitted_fp8"][i], x, queries, ev["cos"], ev["sin"], "fp8")
        if i not in ev["layers"]:
            return
        probs = attention_probs(q, k, queries)
        if kind == "prose":
            tally.add(("token0", i, 0, "attention"), probs[:, 0])
        exact = (indexer_logits(ev["fitted_exact"][i], x, queries, ev["cos"], ev["sin"], "exact")
                 if i in ev["fitted_exact"] else None)
        untrained = indexer_logits(ev["untrained"][i], x, queries, ev["cos"], ev["sin"], "fp8")
        for kk in ks:
            rows = queries + 1 > kk
            if not bool(rows.any()):
                continue
            qs, p = queries[rows], probs[rows]
            sel = {"oracle": oracle(p, qs, kk), "sink_recent": sink_recent(qs, kk), "untrained": select(untrained[rows], qs, kk)}
            if i in fp8_logits:
                sel["fitted_fp8"] = select(fp8_logits[i][rows], qs, kk)
            if exact is not None:
                sel["fitted_exact"] = select(exact[rows], qs, kk)
            if kind != "prose":
                for name, s in sel.items():
                    tally.add((kind, i, kk, name), hits(s, targets[rows]))
                continue
            for name, s in sel.items():
                tally.add(("mass", i, kk, name), mass(p, s))
                if name != "oracle":
                    tally.add(("no_sink", i, kk, name), mass(p, s, skip_first=True))
            tally.add(("no_sink", i, kk, "oracle"), mass(p, oracle(p, qs, kk, skip_first=True), skip_first=True))
            if "fitted_fp8" in sel and "fitted_exact" in sel:
                tally.add(("agree", i, kk, "fp8_vs_exact"), agreement(sel["fitted_fp8"], sel["fitted_exact"], t))
            for f, src in ev["sources"].items():
                if i in src:
                    tally.add(("reuse", i, kk, str(f)), mass(p, select(fp8_logits[src[i]][rows], qs, kk)))

    teacher.hidden(ids, layers=max(ev["layers"]) + 1, observe=observe)


# ---- one run ----------------------------------------------------------------------------------------
def selectors(teacher, fitted: dict, layers, context: int, seed: int) -> dict:
    """The ``ev`` of :func:`score`: the ``fitted`` indexers ``{layer: indexer}`` as loaded (``fitted_exact``)
    and as bfloat16 copies (``fitted_fp8``, the deployed FP8 path), freshly initialized ones on ``layers``
    (``untrained``, seeded with ``seed``), each skip pattern's reuse sources and RoPE tables of ``context``."""
    cfg, device = teacher.config, teacher.device
    fitted_bf16 = {i: LightningIndexer(m.config).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
                   for i, m in fitted.items()}
    for i, m in fitted_bf16.items():
        m.load_state_dict(fitted[i].state_dict())
    icfg = next(iter(fitted.values())).config
    torch.manual_seed(seed)
    untrained = {i: LightningIndexer(indexer_config(cfg, icfg.index_n_heads)).to(device=device, dtype=torch.bfloat16)
                 .requires_grad_(False) for i in layers}
    cos, sin = rope_tables(icfg, context, device)
    return {"fitted_fp8": fitted_bf16, "fitted_exact": fitted, "untrained": untrained, "layers": set(layers),
            "sources": {f: reuse_source(fitted, f, cfg.num_layers) for f in PATTERNS}, "cos": cos, "sin": sin}


def measure(teacher, ev: dict, prose: list, copies: list, passkeys: list, ks, queries: int, low: int,
            g: torch.Generator) -> Tally:
    """Every sequence scored into one :class:`Tally`: the ``prose`` windows at ``queries`` positions drawn
    from ``[low, window)`` with ``g``, then the ``(ids, queries, targets)`` of ``copies`` and ``passkeys``."""
    tally = Tally()
    with torch.no_grad():
        jobs = ([(w, sample_queries(w.numel(), queries, low, g), None, "prose") for w in prose]
                + [(ids, q, tg, "copy") for ids, q, tg in copies] + [(ids, q, tg, "passkey") for ids, q, tg in passkeys])
        for ids, q, tg, kind in tqdm(jobs, desc="recall --teacher"):
            score(teacher, ids, q, ks, ev, tally, targets=tg, kind=kind)
    return tally


# ---- tables ---------------------------------------------------------------------------------------
def table(tally: Tally, layers, ks) -> list:
    rows = []
    for i in layers:
        for k in ks:
            r = {"layer": i, "k": k, "queries": tally.n.get(("mass", i, k, "oracle"), 0),
                 "attention_on_token0": tally.mean(("token0", i, 0, "attention"))}
            r.update({m: tally.mean(("mass", i, k, m)) for m in METHODS})
            r["no_sink"] = {m: tally.mean(("no_sink", i, k, m)) for m in METHODS}
            r["fp8_vs_exact"] = tally.mean(("agree", i, k, "fp8_vs_exact"))
            r["skip_pattern"] = {str(f): tally.mean(("reuse", i, k, str(f))) for f in PATTERNS}
            for kind in ("copy", "passkey"):
                r[f"{kind}_hits"] = {m: tally.mean((kind, i, k, m)) for m in METHODS}
            rows.append(r)
    return rows


def _avg(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list, ks, target_k: int) -> dict:
    """Means over the layers that have a fitted indexer (all of them in a full run), per ``k``."""
    by_k = []
    for k in ks:
        at = [r for r in rows if r["k"] == k and r["fitted_fp8"] is not None]
        mid = [r for r in at if 3 <= r["layer"] <= 8]
        s = {"k": k, **{m: _avg([r[m] for r in at]) for m in METHODS},
             "no_sink": {m: _avg([r["no_sink"][m] for r in at]) for m in METHODS},
             "layers_3_8": {m: _avg([r[m] for r in mid]) for m in METHODS},
             "fp8_vs_exact": _avg([r["fp8_vs_exact"] for r in at]),
             "skip_pattern": {f: _avg([r["skip_pattern"][f] for r in at]) for f in map(str, PATTERNS)}}
        by_k.append(s)
    return {"by_k": by_k, "targets": targets(rows, by_k, target_k)}


def targets(rows, by_k, target_k: int) -> dict:
    """The issue's targets at ``target_k`` (hits at k = 64), each with the value measured and whether it holds."""
    s = next((b for b in by_k if b["k"] == target_k), None)
    out = {}
    if s is None or s["oracle"] is None or s["fitted_fp8"] is None:
        return out
    ratio = s["fitted_fp8"] / s["oracle"]
    out["fitted_over_oracle_all_layers"] = {"value": ratio, "target": ">= 0.90", "met": ratio >= 0.90}
    mid, sr = s["layers_3_8"]["fitted_fp8"], s["layers_3_8"]["sink_recent"]
    if mid is not None:
        out["fitted_layers_3_8"] = {"value": mid, "target": ">= 0.70", "met": mid >= 0.70}
        out["fitted_minus_sink_recent_layers_3_8"] = {"value": mid - sr, "target": ">= 0.25", "met": mid - sr >= 0.25}
    if s["fp8_vs_exact"] is not None:
        out["fp8_vs_exact"] = {"value": s["fp8_vs_exact"], "target": ">= 0.95", "met": s["fp8_vs_exact"] >= 0.95}
    for kind in ("copy", "passkey"):
        strong = [r for r in rows if r["k"] == 64 and (r[f"{kind}_hits"]["oracle"] or 0) >= 0.95
                  and r[f"{kind}_hits"]["fitted_fp8"] is not None]
        if strong:
            worst = min(r[f"{kind}_hits"]["fitted_fp8"] for r in strong)
            out[f"{kind}_hits_top64"] = {"layers": [r["layer"] for r in strong], "value": worst,
                                        "mean": _avg([r[f"{kind}_hits"]["fitted_fp8"] for r in strong]),
                                        "target": ">= 0.95 in every layer where the oracle has >= 0.95",
                                        "met": worst >= 0.95}
    return out


def sparse_targets(sparse: dict, target_k: int) -> dict:
    row = next((r for r in sparse["by_k"] if r["k"] == target_k), None)
    if row is None:
        return {}
    gap = row["fitted"]["1"]["all"] - sparse["dense"]["all"]
    return {"sparse_loss_gap": {"value": gap, "oracle_gap": row["oracle"]["all"] - sparse["dense"]["all"],
                                "target": "<= 0.05 nats/token", "met": gap <= 0.05}}
