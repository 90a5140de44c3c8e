"""``dsa fit-indexer``: fit lightning indexers to a frozen teacher's attention (DeepSeek-V3.2's two indexer stages).

Each chosen layer of the teacher gets a ``LightningIndexer`` that reads the layer's normed hidden state.
Every step draws a window and its query rows (``draw``: random windows of ``--context`` training tokens
with random rows, and with ``--retrieval`` windows with retrieval structure, :mod:`dsa.quality.retrieval_mix`),
runs the frozen teacher once, and for each layer minimizes one of V3.2's two indexer losses:

    dense warm-up   KL( mean_h attention_h[q, :]  ||  softmax_s(indexer logit[q, s]) )      over s <= q
    sparse stage    the same KL over the indexer's own top-k of each row (``k = T / sparse_k_fraction``),
                    the teacher's attention being each head's softmax over that set (what the sparse model
                    attends to), both renormalized there: :func:`dsa.quality.selection.selected_set_kl`, the
                    loss of the trained default's stage (c); the teacher is frozen, so the input is detached

on exact-precision logits (no Hadamard, no FP8: the FP8 path is not differentiable), with Adam at
``--lr`` (the paper: 1e-3, 1000 steps of 16 x 128K tokens; here scaled down, bounded by ``--steps`` and
``--max-minutes``, which bounds the whole command, the held-out KL before and after included). The last
``--sparse-share`` of the steps (by count, or of the training time under ``--max-minutes``) run the
sparse stage. ``--init`` continues from fitted indexers. Writes one ``layer_XX.safetensors`` per layer,
``fit.json`` (arguments, loss curve, held-out KL before and after) and ``fit_loss.png``, and the
indexers and a partial ``fit.json`` every ``--checkpoint-minutes`` while training.
"""
import time

import torch
from tqdm import tqdm

from dsa.indexer import LightningIndexer
from dsa.quality.selection import indexer_config, indexer_logits, rope_tables, selected_set_kl, topk_mask, warmup_kl
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


def teacher_targets(teacher, ids, layers, queries, until=None, clock=time.perf_counter, allowed_of=None) -> dict:
    """``{layer: (x [T, hidden], probs [Q, T], allowed [Q, T] or None)}`` from one frozen teacher pass (stops
    after the last layer): ``allowed_of(layer, x)`` (optional) restricts each row's attention to a set, each
    head's softmax taken over it; with ``until`` (a ``clock()`` time) it raises :class:`OutOfTime` after the
    layer that passes it."""
    wanted, out = set(layers), {}

    def observe(i, x, q, k):
        if i in wanted:
            allowed = None if allowed_of is None else allowed_of(i, x)
            out[i] = (x, attention_probs(q, k, queries, allowed=allowed), allowed)
        if until is not None and clock() > until:
            raise OutOfTime
    teacher.hidden(ids, layers=max(layers) + 1, observe=observe)
    return out


def step_losses(teacher, indexers: dict, ids, queries, cos, sin, sparse_k: int | None, until=None,
                clock=time.perf_counter) -> dict:
    """``{layer: loss}`` of one window: the dense warm-up KL, or with ``sparse_k`` the selected-set KL over
    each row's top-``sparse_k`` of the indexer's exact logits (rows whose past fits attend to all of it)."""
    allowed_of = None
    if sparse_k is not None:
        def allowed_of(i, x):
            return topk_mask(indexer_logits(indexers[i], x, queries, cos, sin, "exact"), sparse_k)
    targets = teacher_targets(teacher, ids, list(indexers), queries, until, clock, allowed_of)
    out = {}
    for i, (x, probs, allowed) in targets.items():
        logits = indexer_logits(indexers[i], x, queries, cos, sin, "exact")
        out[i] = warmup_kl(logits, probs) if allowed is None else selected_set_kl(logits, probs, allowed)
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
                         for i, (x, probs, _) in targets.items()})
            bar.update(1)
    return rows


def _mean(rows: list) -> dict:
    return {i: sum(r[i] for r in rows) / len(rows) for i in rows[0]} if rows else {}


def new_indexers(teacher, layers, heads: int, seed: int, init: dict | None = None) -> dict:
    """``{layer: trainable fp32 LightningIndexer}``: fresh (seeded), or copies of ``init``'s where it has the layer."""
    torch.manual_seed(seed)
    out = {i: LightningIndexer(indexer_config(teacher.config, heads)).to(teacher.device) for i in layers}
    for i, idx in (init or {}).items():
        if i in out:
            if idx.config.index_n_heads != heads:
                raise ValueError(f"init: layer {i}'s indexer has {idx.config.index_n_heads} heads, the fit {heads}")
            out[i].load_state_dict({k: v.float() for k, v in idx.state_dict().items()})
    return {i: m.train().requires_grad_(True) for i, m in out.items()}


def sparse_phase(step: int, steps: int, t: float, budget: float | None, share: float) -> bool:
    """Whether a step runs the sparse stage: the last ``share`` of ``steps``, or of the training ``budget``
    (seconds; ``t`` seconds into it) when the time decides."""
    if share <= 0:
        return False
    if budget is not None:
        return t >= (1 - share) * budget
    return step >= (1 - share) * steps


def fit(teacher, layers, draw, heldout_batches, *, heads=4, context=8192, steps=1000, max_seconds=None, lr=1e-3,
        warmup=20, seed=0, init=None, sparse_share=0.0, sparse_k_fraction=16, checkpoint=None,
        checkpoint_seconds=120.0, progress=True, clock=time.perf_counter) -> tuple:
    """Train one indexer per layer on the windows of ``draw(g) -> (ids [T <= context], queries [Q])``;
    returns ``({layer: LightningIndexer}, record)``.

    ``max_seconds`` bounds the whole call (``clock`` reads the time): the held-out KL before training
    evaluates the windows that fit in ``EVAL_SHARE`` of it; a step starts only while the mean step
    and the evaluation after (the same windows, timed before) still fit; the evaluation after stops
    at the budget. A window or step whose teacher pass outlasts its phase is abandoned between two
    layers, so no phase overruns by more than one layer's pass and the step after it (the backward).
    Before and after are reported on the windows both evaluated. The last ``sparse_share`` of training
    runs the sparse stage at ``k = T // sparse_k_fraction`` (:func:`sparse_phase`); ``checkpoint(indexers,
    record, stage)`` is called every ``checkpoint_seconds`` of training with the record so far (``stage``
    None), and once at the dense stage's end (``stage`` ``"dense"``) when a sparse stage follows."""
    start = clock()
    end = None if max_seconds is None else start + max_seconds
    indexers = new_indexers(teacher, layers, heads, seed, init)
    params = [p for idx in indexers.values() for p in idx.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    cfg = next(iter(indexers.values())).config
    cos, sin = rope_tables(cfg, max([context] + [ids.numel() for ids, _ in heldout_batches]), teacher.device)
    t_eval = clock()
    before = heldout_kl(teacher, indexers, heldout_batches, cos, sin, clock=clock, progress=progress,
                        until=None if end is None else t_eval + EVAL_SHARE * max_seconds, desc="held-out KL before")
    reserve = (clock() - t_eval) / max(1, len(before)) * len(before)  # the evaluation after, on the same windows
    g = torch.Generator().manual_seed(seed)
    curve, t0, saved, phases = [], clock(), clock(), {"dense": 0, "sparse": 0}
    budget = None if end is None else end - reserve - t0
    bar = tqdm(range(steps), desc="fit-indexer", disable=not progress)
    for step in bar:
        if end is not None and clock() + (clock() - t0) / max(1, len(curve)) + reserve > end:
            break
        ids, q = draw(g)
        sparse = sparse_phase(step, steps, clock() - t0, budget, sparse_share)
        if sparse and not phases["sparse"] and checkpoint is not None:  # the dense stage's end, kept apart
            so_far = {"steps": len(curve), "train_seconds": round(clock() - t0, 1), "curve": curve}
            checkpoint(indexers, so_far, "dense")
        try:
            losses = step_losses(teacher, indexers, ids, q.to(teacher.device), cos, sin,
                                 ids.numel() // sparse_k_fraction if sparse else None,
                                 None if end is None else end - reserve, clock)
        except OutOfTime:
            break
        opt.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        opt.step()
        sched.step()
        row = {i: float(v.detach()) for i, v in losses.items()}
        stage = "sparse" if sparse else "dense"
        phases[stage] += 1
        curve.append({"step": step, "seconds": round(clock() - t0, 2), "stage": stage, "tokens": ids.numel(),
                      "rows": len(q), "mean_kl": sum(row.values()) / len(row), "kl": row})
        bar.set_postfix(kl=f"{curve[-1]['mean_kl']:.3f}", **({} if end is None else {"left": f"{end - clock():.0f}s"}))
        if checkpoint is not None and clock() - saved >= checkpoint_seconds:
            checkpoint(indexers, {"steps": len(curve), "train_seconds": round(clock() - t0, 1), "curve": curve}, None)
            saved = clock()
    bar.close()
    seconds, done = clock() - t0, len(curve)
    after = heldout_kl(teacher, indexers, heldout_batches[:len(before)], cos, sin, clock=clock, progress=progress,
                       until=end, desc="held-out KL after") if done else []
    common = len(after) if after else len(before)
    record = {"steps": done, "steps_by_stage": phases, "train_seconds": round(seconds, 1),
              "seconds": round(clock() - start, 1), "max_seconds": max_seconds,
              "tokens_seen": sum(c["tokens"] for c in curve), "query_rows_per_layer": sum(c["rows"] for c in curve),
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
    switch = next((c["step"] for c in curve if c.get("stage") == "sparse"), None)
    if switch is not None:
        ax.axvline(switch, color="0.5", ls="-.", label=f"sparse stage (selected-set KL) from step {switch}")
    for name, style in (("heldout_kl_before", "r:"), ("heldout_kl_after", "g--")):
        if record.get(name):
            v = sum(record[name].values()) / len(record[name])
            ax.axhline(v, color=style[0], ls=style[1:], label=f"held-out mean, {name.split('_')[-1]} ({v:.3f})")
    ax.set(xlabel="optimizer step", ylabel="KL(attention || indexer softmax) [nats]", yscale="log", title=title)
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "fit_loss.png")
