"""The tables and figures of ``dsa recall --teacher`` (:mod:`dsa.quality.teacher_recall` scores):
the attention mass kept per layer and per ``k``, the copy and pass-key hits, the sparse loss."""
from dsa.quality.teacher_recall import METHODS
from dsa.report import save_figure

FILES = ("quality.json", "quality_by_layer.png", "quality_by_k.png", "sparse_loss.png")  # what the command writes
LABELS = {"fitted_fp8": "fitted indexer, FP8", "fitted_exact": "fitted indexer, exact", "oracle": "oracle top-k",
          "sink_recent": "sink + recent", "untrained": "untrained indexer"}
STYLES = {"fitted_fp8": "o-", "fitted_exact": "x--", "oracle": "s-", "sink_recent": "v:", "untrained": "d:"}


def plot(result: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, rows, paths = result["args"], result["table"], []
    k0 = a["target_k"] if a["target_k"] in a["topk"] else a["topk"][len(a["topk"]) // 2]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    at = [r for r in rows if r["k"] == k0]
    for m in METHODS:
        pts = [(r["layer"], r[m]) for r in at if r[m] is not None]
        if pts:
            ax.plot(*zip(*pts), STYLES[m], label=LABELS[m], ms=4)
    ax.set(ylabel="attention mass kept", ylim=(0, 1.02),
           title=f"{result['teacher']['name']}: top-{k0} of {a['context']} tokens, held-out text")
    ax.legend(fontsize=8, ncol=2)
    at64 = [r for r in rows if r["k"] == 64]
    for kind, style in (("copy", "-"), ("passkey", "--")):
        for m, color in (("oracle", "C2"), ("fitted_fp8", "C0")):
            pts = [(r["layer"], r[f"{kind}_hits"][m]) for r in at64 if r[f"{kind}_hits"][m] is not None]
            if pts:
                bx.plot(*zip(*pts), style, color=color, marker=".", label=f"{kind} target, {LABELS[m]}")
    bx.set(xlabel="layer", ylabel="target in the top-64 (share of queries)", ylim=(-0.02, 1.02))
    if bx.get_legend_handles_labels()[0]:
        bx.legend(fontsize=8, ncol=2)
    paths.append(save_figure(fig, out_dir, FILES[1]))

    fig, ax = plt.subplots(figsize=(7, 4))
    by_k = result["summary"]["by_k"]
    ks = [b["k"] for b in by_k]
    for m in METHODS:
        if any(b[m] is not None for b in by_k):
            ax.plot(ks, [b[m] for b in by_k], STYLES[m], label=LABELS[m])
    for f in ("2", "4"):
        ax.plot(ks, [b["skip_pattern"][f] for b in by_k], "-", alpha=0.6, label=f"fitted FP8, indexer every {f} layers")
    ax.set(xscale="log", xlabel="k (positions kept)", ylabel="attention mass kept (mean over layers)", ylim=(0, 1.02),
           title=f"selection quality vs k ({a['context']}-token held-out windows)")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir, FILES[2]))

    sp = result.get("sparse_loss")
    if sp:
        fig, ax = plt.subplots(figsize=(7, 4))
        ks = [r["k"] for r in sp["by_k"]]
        ax.axhline(sp["dense"]["all"], color="k", lw=1, label=f"dense ({sp['dense']['all']:.3f})")
        ax.plot(ks, [r["oracle"]["all"] for r in sp["by_k"]], "s-", label="oracle top-k")
        for f in sp["by_k"][0]["fitted"]:
            ax.plot(ks, [r["fitted"][f]["all"] for r in sp["by_k"]], "o-", label=f"fitted FP8, indexer every {f}")
        ax.set(xscale="log", xlabel="k (positions each query attends to)", ylabel="held-out loss [nats/token]",
               title="loss with every layer's attention restricted to top-k")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir, FILES[3]))
    return paths


def summary_text(result: dict) -> str:
    a = result["args"]
    fmt = lambda x: "    -" if x is None else f"{x:5.3f}"  # noqa: E731
    k0 = a["target_k"] if a["target_k"] in a["topk"] else a["topk"][len(a["topk"]) // 2]
    lines = [f"{result['teacher']['name']}, {a['context']}-token windows, k = {k0}: attention mass kept",
             "layer  fp8   exact oracle sink+rec untrained  fp8(no tok0) oracle(no tok0)  fp8~exact  copy@64 passkey@64"]
    r64 = {r["layer"]: r for r in result["table"] if r["k"] == 64}
    for r in (r for r in result["table"] if r["k"] == k0):
        h = r64.get(r["layer"], {})
        lines.append(f"{r['layer']:5d}  {fmt(r['fitted_fp8'])} {fmt(r['fitted_exact'])} {fmt(r['oracle'])}  "
                     f"{fmt(r['sink_recent'])}    {fmt(r['untrained'])}     {fmt(r['no_sink']['fitted_fp8'])}"
                     f"        {fmt(r['no_sink']['oracle'])}       {fmt(r['fp8_vs_exact'])}   "
                     f"{fmt(h.get('copy_hits', {}).get('fitted_fp8'))}   {fmt(h.get('passkey_hits', {}).get('fitted_fp8'))}")
    lines.append("mean over layers by k: " + "; ".join(
        f"k={b['k']}: fp8 {fmt(b['fitted_fp8'])} oracle {fmt(b['oracle'])} sink+recent {fmt(b['sink_recent'])}"
        for b in result["summary"]["by_k"]))
    for name, t in result["summary"]["targets"].items():
        lines.append(f"target {name}: {t['value']:.3f} ({t['target']}) {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def sparse_text(result: dict) -> str:
    sp = result["sparse_loss"]
    lines = [f"held-out loss, nats/token (all tokens / second half): dense {sp['dense']['all']:.4f} / "
             f"{sp['dense']['second_half']:.4f}"]
    for r in sp["by_k"]:
        fitted = "  ".join(f"every {f}: {v['all']:.4f} / {v['second_half']:.4f}" for f, v in r["fitted"].items())
        lines.append(f"k={r['k']:5d}  oracle {r['oracle']['all']:.4f} / {r['oracle']['second_half']:.4f}  fitted FP8 {fitted}")
    for name, t in result["summary"]["targets"].items():
        if name.startswith("sparse"):
            lines.append(f"target {name}: {t['value']:.4f} ({t['target']}; oracle {t['oracle_gap']:.4f}) "
                         f"{'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)
