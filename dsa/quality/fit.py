"""``dsa fit-indexer``: fit lightning indexers to a frozen teacher's attention (DeepSeek-V3.2's dense warm-up).

Each chosen layer of the teacher gets a ``LightningIndexer`` that reads the layer's normed hidden state.
Every step takes a random window of ``--context`` training tokens, runs the frozen teacher once, and
for ``--queries`` random query positions per layer minimizes

    KL( mean_h attention_h[q, :]  ||  softmax_s(indexer logit[q, s]) )      over s <= q

on exact-precision logits (no Hadamard, no FP8: the FP8 path is not differentiable), with Adam at
``--lr`` (the paper: 1e-3, 1000 steps of 16 x 128K tokens; here scaled down, bounded by ``--steps`` and
``--max-minutes``). Writes one ``layer_XX.safetensors`` per layer (bfloat16), ``fit.json`` (arguments,
loss curve, held-out KL before and after) and ``fit_loss.png``.
"""
import time

import torch
from tqdm import tqdm


def parse_layers(spec: str, num_layers: int) -> list:
    if spec == "all":
        return list(range(num_layers))
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--layers: {bad} outside 0..{num_layers - 1}")
    return sorted(out)


def sample_queries(t: int, n: int, low: int, generator: torch.Generator) -> torch.Tensor:
    low = min(max(low, 0), t - 1)
    n = min(n, t - low)
    return (torch.randperm(t - low, generator=generator)[:n] + low).sort().values


def teacher_targets(teacher, ids, layers, queries) -> dict:
    """``{layer: (x [T, hidden], probs [Q, T])}`` from one frozen teacher pass (stops after the last layer)."""
    from dsa.quality.teacher import attention_probs

    wanted, out = set(layers), {}

    def observe(i, x, q, k):
        if i in wanted:
            out[i] = (x, attention_probs(q, k, queries))
    teacher.hidden(ids, layers=max(layers) + 1, observe=observe)
    return out


def heldout_kl(teacher, indexers, batches, cos, sin) -> dict:
    """Mean warm-up KL per layer over fixed held-out ``(ids, queries)`` batches (exact logits)."""
    from dsa.quality.selection import indexer_logits, warmup_kl

    sums = {i: 0.0 for i in indexers}
    with torch.no_grad():
        for ids, queries in batches:
            for i, (x, probs) in teacher_targets(teacher, ids, list(indexers), queries).items():
                sums[i] += float(warmup_kl(indexer_logits(indexers[i], x, queries, cos, sin, "exact"), probs))
    return {i: s / max(1, len(batches)) for i, s in sums.items()}


def fit(teacher, layers, streams, heldout_batches, *, heads=4, context=8192, queries=256, min_position=256,
        steps=1000, max_seconds=None, lr=1e-3, warmup=20, seed=0, progress=True) -> tuple:
    """Train one indexer per layer; returns ``({layer: LightningIndexer}, record)``."""
    from dsa.indexer import LightningIndexer
    from dsa.quality.corpus import sample_window
    from dsa.quality.selection import indexer_config, indexer_logits, rope_tables, warmup_kl

    device = teacher.device
    cfg = indexer_config(teacher.config, heads)
    torch.manual_seed(seed)
    indexers = {i: LightningIndexer(cfg).to(device) for i in layers}
    params = [p for idx in indexers.values() for p in idx.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    cos, sin = rope_tables(cfg, max([context] + [ids.numel() for ids, _ in heldout_batches]), device)
    before = heldout_kl(teacher, indexers, heldout_batches, cos, sin) if heldout_batches else {}
    g = torch.Generator().manual_seed(seed)
    curve, t0, done = [], time.perf_counter(), 0
    bar = tqdm(range(steps), desc="fit-indexer", disable=not progress)
    for step in bar:
        ids = sample_window(streams, context, g)
        q = sample_queries(context, queries, min_position, g).to(device)
        targets = teacher_targets(teacher, ids, layers, q)
        losses = {i: warmup_kl(indexer_logits(indexers[i], x, q, cos, sin, "exact"), probs)
                  for i, (x, probs) in targets.items()}
        opt.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        opt.step()
        sched.step()
        row = {i: float(v.detach()) for i, v in losses.items()}
        curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 2),
                      "mean_kl": sum(row.values()) / len(row), "kl": row})
        bar.set_postfix(kl=f"{curve[-1]['mean_kl']:.3f}")
        done = step + 1
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    seconds = time.perf_counter() - t0
    after = heldout_kl(teacher, indexers, heldout_batches, cos, sin) if heldout_batches else {}
    record = {"steps": done, "train_seconds": round(seconds, 1), "tokens_seen": done * context,
              "query_rows_per_layer": done * queries, "curve": curve,
              "heldout_kl_before": before, "heldout_kl_after": after}
    return indexers, record


def plot_curve(record: dict, out_dir: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsa.bench.plot import save_figure

    curve = record["curve"]
    steps = [c["step"] for c in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    layers = sorted(curve[0]["kl"]) if curve else []
    for i in layers:
        ax.plot(steps, [c["kl"][i] for c in curve], lw=0.5, alpha=0.35)
    mean = [c["mean_kl"] for c in curve]
    win = max(1, len(mean) // 50)
    smooth = [sum(mean[max(0, j - win + 1):j + 1]) / len(mean[max(0, j - win + 1):j + 1]) for j in range(len(mean))]
    ax.plot(steps, smooth, "k-", lw=2, label=f"mean over {len(layers)} layers (running mean of {win} steps)")
    for name, style in (("heldout_kl_before", "r:"), ("heldout_kl_after", "g--")):
        if record.get(name):
            v = sum(record[name].values()) / len(record[name])
            ax.axhline(v, color=style[0], ls=style[1:], label=f"held-out mean, {name.split('_')[-1]} ({v:.3f})")
    ax.set(xlabel="optimizer step", ylabel="KL(attention || indexer softmax) [nats]", yscale="log", title=title)
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "fit_loss.png")
