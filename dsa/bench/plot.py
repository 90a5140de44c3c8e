"""``dsa bench plot``: figures from committed benchmark JSON (no GPU needed).

- ``time_vs_context.png``: median time against context length for every op row that has one
  (``S`` or ``L`` in its shape), one line per (op, impl, B), with the time the same-run copy
  bandwidth needs for the row's bytes drawn dashed beside it (its floor).
- ``dsa_vs_dense.png``: one layer's decode attention, DSA (indexer + top-k + sparse MLA) against
  the dense absorbed decode, by context length (from ``bench layer``).
"""
import os
from collections import defaultdict

from .report import load_results


def _context(shape: dict):
    return shape.get("S", shape.get("L"))


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
    series = defaultdict(list)
    for op, d in newest.items():
        copy = d["ceilings"]["copy_tbps"]
        for r in d["rows"]:
            s = _context(r.get("shape", {}))
            if s is None or r.get("median_us") is None or op in ("crossover", "layer"):
                continue
            key = (r["name"], r["impl"], r["shape"].get("B"), r["shape"].get("N", 1))
            floor = r["bytes"] / (copy * 1e12) * 1e6 if r.get("bytes") else None
            series[key].append((s, r["median_us"], floor))
    if series:
        fig, ax = plt.subplots(figsize=(8, 5))
        for (name, impl, b, n), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
            pts.sort()
            if len(pts) < 2:
                continue
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{name} [{impl}] B={b} N={n}")
            if all(p[2] for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(), alpha=0.5)
        ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="median us (dashed: copy-bandwidth floor)",
               title="time vs context, same-run ceilings")
        ax.legend(fontsize=6, ncol=2)
        paths.append(_save(fig, out_dir, "time_vs_context.png"))
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
        paths.append(_save(fig, out_dir, "dsa_vs_dense.png"))
    return paths


def _save(fig, out_dir, name):
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
