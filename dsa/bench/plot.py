"""``dsa bench plot``: figures from committed benchmark JSON (no GPU needed).

- ``time_vs_context.png``: one panel per op, median time against context length of its B=64 rows,
  one line per (op, impl, N, cache format), with the row's floor at the same-run ceiling dashed
  beside it (bytes at the copy bandwidth, or FLOPs at the matmul rate, by the row's bound).
- ``dsa_vs_dense.png``: one layer's decode attention, DSA (indexer + top-k + sparse MLA) against
  the dense absorbed decode, by context length (from ``bench layer``).
"""
import os
from collections import defaultdict

from dsa.report import save_figure

from .report import load_results

FIGURES = ("time_vs_context.png", "dsa_vs_dense.png")  # what plot_results writes (each when it has rows)


def _context(shape: dict):
    return shape.get("S", shape.get("L"))


def _floor_us(row: dict, ceilings: dict):
    """The row's time at its same-run ceiling: bytes at the copy bandwidth, or FLOPs at the matmul rate."""
    bound = row.get("bound")
    if bound == "copy" and row.get("bytes"):
        return row["bytes"] / (ceilings["copy_tbps"] * 1e12) * 1e6
    if bound in ("bf16", "fp8") and row.get("flops"):
        return row["flops"] / (ceilings[f"{bound}_tflops"] * 1e12) * 1e6
    return None


def plot_results(results: str, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = load_results(results)
    newest = {}
    for d in docs:  # load_results sorts newest first within each op
        newest.setdefault(d["op"], d)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    panels = defaultdict(lambda: defaultdict(list))  # op -> (name, impl, N) -> [(S, us, floor us)]
    for op, d in newest.items():
        if op in ("crossover", "layer") or op.endswith("-sweep"):  # tuning sweeps: variants, not context curves
            continue
        for r in d["rows"]:
            shape = r.get("shape", {})
            s = _context(shape)
            if s is None or r.get("median_us") is None or shape.get("B") != 64 or "=" in r["impl"]:
                continue  # (an impl with "=" is a knob variant of --variants)
            panels[op][(r["name"], r["impl"], shape.get("N", 1), shape.get("cache", ""))].append(
                (s, r["median_us"], _floor_us(r, d["ceilings"])))
    panels = {op: {k: v for k, v in series.items() if len(v) > 1} for op, series in panels.items()}
    panels = {op: series for op, series in panels.items() if series}
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
        for ax, (op, series) in zip(axes[0], sorted(panels.items())):
            for (name, impl, n, cache), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
                pts.sort()
                label = f"{name} [{impl}] N={n}" + (f" {cache}" if cache else "")
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
                if all(p[2] for p in pts):
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(), alpha=0.6)
            ax.set(xscale="log", yscale="log", xlabel="context length", title=f"bench {op}, B=64",
                   ylabel="median us (dashed: same-run ceiling floor)")
            ax.legend(fontsize=7)
        paths.append(save_figure(fig, out_dir, FIGURES[0]))
    layer = newest.get("layer")
    if layer:
        fig, ax = plt.subplots(figsize=(7, 4))
        by = defaultdict(dict)
        for r in layer["rows"]:
            if r["name"] in ("layer_dsa_attention", "layer_dense_attention"):
                by[(r["name"], r["shape"]["B"])][r["shape"]["S"]] = r["median_us"]
        for (name, b), pts in sorted(by.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], "o-" if "dsa" in name else "s--",
                    label=f"{'DSA' if 'dsa' in name else 'dense'} B={b}")
        ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="median us per layer decode step",
               title="one layer's decode attention: DSA vs dense (H200)")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir, FIGURES[1]))
    return paths

