"""``dsa fit-indexer``: fit lightning indexers to a frozen teacher's attention (DeepSeek-V3.2's dense warm-up).

Each chosen layer of the teacher gets a ``LightningIndexer`` that reads the layer's normed hidden state.
Every step takes a random window of ``--context`` training tokens, runs the frozen teacher once, and
for ``--queries`` random query positions per layer minimizes

    KL( mean_h attention_h[q, :]  ||  softmax_s(indexer logit[q, s]) )      over s <= q

on exact-precision logits (no Hadamard, no FP8: the FP8 path is not differentiable), with Adam at
``--lr`` (the paper: 1e-3, 1000 steps of 16 x 128K tokens; here scaled down, bounded by ``--steps`` and
``--max-minutes``, which bounds the whole command, the held-out KL before and after included). Writes
one ``layer_XX.safetensors`` per layer (bfloat16), ``fit.json`` (arguments, loss curve, held-out KL
before and after) and ``fit_loss.png``.
"""
import time

import torch
from tqdm import tqdm

from dsa.indexer import LightningIndexer
from dsa.quality.corpus import sample_window
from dsa.quality.selection import indexer_config, indexer_logits, rope_tables, warmup_kl
from dsa.quality.teacher import attention_probs
from dsa.report import save_figure

EVAL_SHARE = 0.2  # of a time budget, for the held-out KL before training (the one after gets as long)


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


class OutOfTime(Exception):
    """A teacher pass given ``until`` passed it (checked after each layer) and was abandoned."""


def teacher_targets(teacher, ids, layers, queries, until=None, clock=time.perf_counter) -> dict:
    """``{layer: (x [T, hidden], probs [Q, T])}`` from one frozen teacher pass (stops after the last layer);
    with ``until`` (a ``clock()`` time) it raises :class:`OutOfTime` after the layer that passes it."""
    wanted, out = set(layers), {}

    def observe(i, x, q, k):
        if i in wanted:
            out[i] = (x, attention_probs(q, k, queries))
        if until is not None and clock() > until:
            raise OutOfTime
    teacher.hidden(ids, layers=max(layers) + 1, observe=observe)
    return out


def heldout_kl(teacher, indexers, batches, cos, sin, *, until=None, clock=time.perf_counter, desc="held-out KL",
               progress=False) -> list:
    """The warm-up KL per layer on each fixed held-out ``(ids, queries)`` batch (exact logits), in order:
    ``[{layer: kl}]``. With ``until`` (a ``clock()`` time) a batch starts only while the mean time of
    those before it still fits, and one that passes it is abandoned between layers: fewer rows then."""
    rows, t0 = [], clock()
    with torch.no_grad(), tqdm(total=len(batches), desc=desc, unit="window", disable=not progress) as bar:
        for ids, queries in batches:
            if rows and until is not None and clock() + (clock() - t0) / len(rows) > until:
                break
            try:
                targets = teacher_targets(teacher, ids, list(indexers), queries, until, clock)
            except OutOfTime:
                break
            rows.append({i: float(warmup_kl(indexer_logits(indexers[i], x, queries, cos, sin, "exact"), probs))
                         for i, (x, probs) in targets.items()})
            bar.update(1)
    return rows


def _mean(rows: list) -> dict:
    return {i: sum(r[i] for r in rows) / len(rows) for i in rows[0]} if rows else {}


def fit(teacher, layers, streams, heldout_batches, *, heads=4, context=8192, queries=256, min_position=256,
        steps=1000, max_seconds=None, lr=1e-3, warmup=20, seed=0, progress=True, clock=time.perf_counter) -> tuple:
    """Train one indexer per layer; returns ``({layer: LightningIndexer}, record)``.

    ``max_seconds`` bounds the whole call (``clock`` reads the time): the held-out KL before training
    evaluates the windows that fit in ``EVAL_SHARE`` of it; a step starts only while the mean step
    and the evaluation after (the same windows, timed before) still fit; the evaluation after stops
    at the budget. A window or step whose teacher pass outlasts its phase is abandoned between two
    layers, so no phase overruns by more than one layer's pass and the step after it (the backward).
    Before and after are reported on the windows both evaluated."""
    start = clock()
    end = None if max_seconds is None else start + max_seconds
    device = teacher.device
    cfg = indexer_config(teacher.config, heads)
    torch.manual_seed(seed)
    indexers = {i: LightningIndexer(cfg).to(device) for i in layers}
    params = [p for idx in indexers.values() for p in idx.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    cos, sin = rope_tables(cfg, max([context] + [ids.numel() for ids, _ in heldout_batches]), device)
    t_eval = clock()
    before = heldout_kl(teacher, indexers, heldout_batches, cos, sin, clock=clock, progress=progress,
                        until=None if end is None else t_eval + EVAL_SHARE * max_seconds, desc="held-out KL before")
    per_window = (clock() - t_eval) / max(1, len(before))
    reserve = per_window * len(before)  # the evaluation after, on the same windows
    g = torch.Generator().manual_seed(seed)
    curve, t0, done = [], clock(), 0
    bar = tqdm(range(steps), desc="fit-indexer", disable=not progress)
    for step in bar:
        if end is not None and clock() + (clock() - t0) / max(1, done) + reserve > end:
            break
        ids = sample_window(streams, context, g)
        q = sample_queries(context, queries, min_position, g).to(device)
        try:
            targets = teacher_targets(teacher, ids, layers, q, None if end is None else end - reserve, clock)
        except OutOfTime:
            break
        losses = {i: warmup_kl(indexer_logits(indexers[i], x, q, cos, sin, "exact"), probs)
                  for i, (x, probs) in targets.items()}
        opt.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        opt.step()
        sched.step()
        row = {i: float(v.detach()) for i, v in losses.items()}
        curve.append({"step": step, "seconds": round(clock() - t0, 2), "mean_kl": sum(row.values()) / len(row),
                      "kl": row})
        bar.set_postfix(kl=f"{curve[-1]['mean_kl']:.3f}", **({} if end is None else {"left": f"{end - clock():.0f}s"}))
        done = step + 1
    bar.close()
    seconds = clock() - t0
    after = heldout_kl(teacher, indexers, heldout_batches[:len(before)], cos, sin, clock=clock, progress=progress,
                       until=end, desc="held-out KL after") if done else []
    common = len(after) if after else len(before)
    record = {"steps": done, "train_seconds": round(seconds, 1), "seconds": round(clock() - start, 1),
              "max_seconds": max_seconds, "tokens_seen": done * context, "query_rows_per_layer": done * queries,
              "curve": curve, "heldout_windows": {"given": len(heldout_batches), "before": len(before),
                                                  "after": len(after)},
              "heldout_kl_before": _mean(before[:common]), "heldout_kl_after": _mean(after)}
    return indexers, record


def plot_curve(record: dict, out_dir: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
