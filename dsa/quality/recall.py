"""``python -m dsa recall``: how much of each layer's attention the indexer's top-k captures.

For one prompt and sampled query positions, every layer:

(a) ``fp8_vs_exact_recall``: recall of the exact indexer's top-k by the FP8 indexer's top-k;
(b) ``mass_recall``: the share of the layer's true softmax attention (float32, averaged over
    heads, computed densely in chunks) that falls on the selection the layer attends with (its
    own FP8 indexer's, or the reused one on a layer that skips), next to ``best_mass_recall``, the
    share on the true top-k of that attention (the best any selection of k can do);
(c) on layers that reuse a selection, ``reused_mass_recall``: the mass on the reused selection
    (to read against that layer's own ``best_mass_recall``); None on layers with their own indexer;
(d) the same over several ``k`` (``--topk``), in ``by_k``; ``by_position`` buckets queries.

Queries are sampled uniformly over the prompt; one whose causal range fits in k attends densely,
so all its recalls are 1 (``by_position`` shows where the selection starts to matter).
Random weights (``--preset``, seed ``--seed``, normal(0, 0.02) init) make attention diffuse:
their numbers exercise the pipeline and are not quality claims. ``--teacher`` measures fitted
indexers on a pretrained model instead (:mod:`dsa.quality.teacher_recall`).
"""

import numpy as np
import torch
from tqdm import tqdm

from dsa.config import layer_runs_indexer
from dsa.report import save_figure

FIGURES = ("recall_by_layer.png", "recall_by_position.png", "recall_by_k.png")  # what plot() writes



def load_tokens(path: str) -> list:
    if path.endswith(".npy"):
        return np.load(path).astype(np.int64).reshape(-1).tolist()
    with open(path) as f:
        return [int(t) for t in f.read().split()]


def top(scores: torch.Tensor, pos: int, k: int) -> torch.Tensor:
    """The ``min(k, pos + 1)`` best of ``scores[0 : pos + 1]``: the positions a query at ``pos`` attends to."""
    return scores[:pos + 1].topk(min(k, pos + 1)).indices


def _recall(selected: torch.Tensor, reference: torch.Tensor) -> float:
    """|selected & reference| / |reference| for 1-D index sets."""
    return len(set(selected.tolist()) & set(reference.tolist())) / max(1, reference.numel())


def capture_layer_inputs(model, ids: torch.Tensor) -> list:
    """Each layer's attention input ``x [S, hidden]`` (after input_layernorm) for one sequence (its rows
    past ``S``, which pad the step's GEMMs, left out)."""
    inputs, s = [], ids.shape[-1]
    hooks = [layer.self_attn.register_forward_pre_hook(lambda mod, args: inputs.append(args[0][:s].detach()))
             for layer in model.layers]
    try:
        model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return inputs


def attention_mass(attn, x, rot, queries, chunk: int = 8) -> torch.Tensor:
    """``[Q, S]`` float32 softmax attention of the sampled queries, averaged over heads."""
    _, q_nope, q_pe, kv_c, k_pe = attn.project(x, rot)
    q_abs = attn.absorbed_query(q_nope[queries], q_pe[queries]).float()  # [Q, H, 576]
    keys = torch.cat((kv_c, k_pe), dim=-1).float()  # [S, 576]
    out = []
    for i in range(0, len(queries), chunk):
        q = q_abs[i:i + chunk]
        score = torch.einsum("qhd,sd->qhs", q, keys) * attn.softmax_scale
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= queries[i:i + chunk, None]
        score = score.masked_fill(~visible[:, None, :], float("-inf"))
        out.append(torch.softmax(score, dim=-1).mean(dim=1))
    return torch.cat(out)


def measure(model, ids: torch.Tensor, ks: list, num_queries: int, seed: int, progress: bool = True) -> dict:
    cfg = model.config
    if cfg.index_topk is None:
        raise ValueError("the model has no indexer (index_topk is None)")
    s = ids.numel()
    ks = sorted(set(ks) | {cfg.index_topk})  # the model's own k is always reported per layer
    g = torch.Generator().manual_seed(seed)
    queries = torch.randperm(s, generator=g)[:num_queries].sort().values.to(model.device)
    positions = torch.arange(s, device=model.device)
    rot = model.rope_at(positions)
    inputs = capture_layer_inputs(model, ids.to(model.device))
    layers, by_k = [], {k: {"mass": [], "best": [], "fp8_vs_exact": []} for k in ks}
    by_pos = {"position": queries.tolist(), "mass_recall": [], "best_mass_recall": []}
    last_scores = None  # FP8 logits of the nearest earlier indexer layer (the reused selection)
    k_model = cfg.index_topk
    for i, (layer, x) in enumerate(tqdm(list(zip(model.layers, inputs)), desc="recall", disable=not progress)):
        attn = layer.self_attn
        qr = attn.project(x, rot)[0]
        mass = attention_mass(attn, x, rot, queries)  # [Q, S]
        own_fp8 = own_exact = None
        if attn.indexer is not None:
            own_fp8 = attn.indexer.score(x, qr, rot, queries, "fp8")
            own_exact = attn.indexer.score(x, qr, rot, queries, "exact")
            last_scores = own_fp8
        used = own_fp8 if own_fp8 is not None else last_scores
        record = {"layer": i, "runs_indexer": layer_runs_indexer(cfg, i)}
        for k in ks:
            m_sel = [float(mass[j, top(used[j], p, k)].sum()) for j, p in enumerate(queries.tolist())]
            m_best = [float(mass[j, top(mass[j], p, k)].sum()) for j, p in enumerate(queries.tolist())]
            agree = ([_recall(top(own_fp8[j], p, k), top(own_exact[j], p, k)) for j, p in enumerate(queries.tolist())]
                     if own_fp8 is not None else [])
            by_k[k]["mass"].append(_mean(m_sel))
            by_k[k]["best"].append(_mean(m_best))
            by_k[k]["fp8_vs_exact"].append(_mean(agree) if agree else None)
            if k == k_model:
                record.update(fp8_vs_exact_recall=_mean(agree) if agree else None, mass_recall=_mean(m_sel),
                              best_mass_recall=_mean(m_best))
                by_pos["mass_recall"].append(m_sel)
                by_pos["best_mass_recall"].append(m_best)
        record["reused_mass_recall"] = record["mass_recall"] if own_fp8 is None else None
        layers.append(record)
    return {"layers": layers,
            "by_k": [{"k": k, "mass_recall": _mean_skip(v["mass"]), "best_mass_recall": _mean_skip(v["best"]),
                      "fp8_vs_exact_recall": _mean_skip(v["fp8_vs_exact"])} for k, v in by_k.items()],
            "by_position": [{"position": p, "mass_recall": _mean([layer[j] for layer in by_pos["mass_recall"]]),
                             "best_mass_recall": _mean([layer[j] for layer in by_pos["best_mass_recall"]])}
                            for j, p in enumerate(by_pos["position"])]}


def _mean(xs):
    return float(sum(xs) / len(xs)) if xs else None


def _mean_skip(xs):
    return _mean([x for x in xs if x is not None])


def _curves(ax, rows: list, x: str) -> None:
    """Mass recall, the best possible, and FP8-vs-exact agreement (where measured) against ``x``."""
    rows = [r for r in rows if r["mass_recall"] is not None]
    xs = [r[x] for r in rows]
    ax.plot(xs, [r["mass_recall"] for r in rows], "o-", label="mass recall (selection used)")
    ax.plot(xs, [r["best_mass_recall"] for r in rows], "s--", label="best possible (true top-k)")
    fp8 = [(r[x], r["fp8_vs_exact_recall"]) for r in rows if r.get("fp8_vs_exact_recall") is not None]
    if fp8:
        ax.plot(*zip(*fp8), "^:", label="FP8 vs exact top-k recall")


def plot(result: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [(FIGURES[0], result["layers"], "layer",
                dict(xlabel="layer (shaded: reuses an earlier selection)", ylabel="recall",
                     title=f"top-{result['args']['index_topk']} recall by layer")),
               (FIGURES[1], result["by_position"], "position",
                dict(xlabel="query position", ylabel="attention mass captured (mean over layers)")),
               (FIGURES[2], result["by_k"], "k", dict(xscale="log", xlabel="k", ylabel="recall (mean over layers)"))]
    paths = []
    for name, rows, x, labels in figures:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        _curves(ax, rows, x)
        if x == "layer":
            for r in rows:
                if not r["runs_indexer"]:
                    ax.axvspan(r["layer"] - 0.5, r["layer"] + 0.5, color="0.9", zorder=0)
        ax.set(ylim=(0, 1.05), **labels)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir, name))
    return paths


def summary(result: dict) -> str:
    a = result["args"]
    lines = [f"top-k recall, k={a['index_topk']}, context {a['context']}, {len(result['by_position'])} queries "
             f"({a.get('checkpoint') or 'random ' + str(a.get('preset'))} weights)",
             "layer  indexer  fp8-vs-exact  mass  best  reused"]
    fmt = lambda x: "   -  " if x is None else f"{x:6.3f}"  # noqa: E731
    for r in result["layers"]:
        lines.append(f"{r['layer']:5d}  {'own' if r['runs_indexer'] else 'reuse':7s}  {fmt(r['fp8_vs_exact_recall'])}"
                     f"        {fmt(r['mass_recall'])} {fmt(r['best_mass_recall'])} {fmt(r['reused_mass_recall'])}")
    lines.append("by k: " + ", ".join(f"k={r['k']}: mass {fmt(r['mass_recall']).strip()} / best "
                                      f"{fmt(r['best_mass_recall']).strip()}" for r in result["by_k"]))
    return "\n".join(lines)
