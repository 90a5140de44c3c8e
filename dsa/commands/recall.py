"""``python -m dsa recall``: top-k recall of the indexer (:mod:`dsa.quality.recall`), or with
``--teacher`` of fitted indexers on a pretrained model (:mod:`dsa.commands.recall_teacher`)."""
import json
import os
import platform

from dsa.commands import recall_teacher
from dsa.commands.options import (
    add_device_argument,
    add_overwrite_argument,
    checkpoint_errors,
    device_from_args,
    refuse_to_overwrite,
)
from dsa.model.preset_names import PRESET_NAMES
from dsa.quality.choices import SWEEP


def add_parser(sub) -> None:
    p = sub.add_parser("recall", help="top-k recall of the indexer: FP8 vs exact, attention mass, reuse")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a HF checkpoint folder")
    src.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="random weights (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights and random prompt seed (default: %(default)s)")
    p.add_argument("--tokens", help="prompt: a file of whitespace-separated token ids, or a .npy array "
                   "(default: random tokens)")
    p.add_argument("--context", type=int, help="random prompt length without --tokens (default: 1024) "
                   "(teacher mode: the preset's)")
    p.add_argument("--queries", type=int, help="query positions sampled (default: 32) (teacher mode: per window)")
    p.add_argument("--topk", help="comma-separated k values for the sweep (default: the powers of two from "
                   f"{SWEEP[0]} to {SWEEP[-1]} below the context, the model's own index_topk always added; "
                   "teacher mode: 64,...,2048)")
    add_device_argument(p)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--out", default="out/recall", help="folder for recall.json (quality.json) and the plots "
                   "(default: %(default)s)")
    add_overwrite_argument(p)
    recall_teacher.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsa.quality.recall import FIGURES
    from dsa.quality.teacher_report import FILES
    from dsa.report import require_matplotlib

    require_matplotlib("dsa recall")
    device = device_from_args(args, "recall")
    names = FILES if args.teacher else ("recall.json", *FIGURES)
    refuse_to_overwrite("recall", "--out", [os.path.join(args.out, n) for n in names], args.overwrite)
    return recall_teacher.run(args, device) if args.teacher else run_model(args, device)


def run_model(args, device) -> int:
    """The indexer of a checkpoint or of a preset's random weights, on ``--tokens`` or random ones."""
    import torch

    from dsa.model import DSAModel
    from dsa.model.presets import PRESETS
    from dsa.quality.recall import load_tokens, measure, plot, summary
    from dsa.report import env_info

    args.context = 1024 if args.context is None else args.context
    args.queries = 32 if args.queries is None else args.queries
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.checkpoint:
        with checkpoint_errors("recall", args.checkpoint):
            model = DSAModel.from_pretrained(args.checkpoint, dtype=dtype, device=device)
    else:
        model = DSAModel.random(PRESETS[args.preset](), seed=args.seed, dtype=dtype, device=device)
    cfg = model.config
    if args.tokens:
        ids = torch.tensor(load_tokens(args.tokens), dtype=torch.long)
    else:
        ids = torch.randint(0, cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(args.seed))
    if args.topk:
        ks = sorted({int(k) for k in args.topk.split(",")})
    else:
        ks = [k for k in SWEEP if k < ids.numel()] or [SWEEP[0]]
    try:
        result = measure(model, ids, ks, args.queries, args.seed)
    except ValueError as e:  # measure checks the model before any work: it has an indexer
        raise SystemExit(f"dsa recall: {e}") from None
    ks = [r["k"] for r in result["by_k"]]
    result = {"args": {**{k: v for k, v in vars(args).items() if k != "func"}, "index_topk": cfg.index_topk,
                       "context": ids.numel(), "topk_sweep": ks, "dtype": str(dtype),
                       "init": "random normal(0, 0.02), norms 1, seed --seed" if not args.checkpoint else "checkpoint"},
              "env": {**env_info(), "platform": platform.platform()}, **result}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "recall.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plots = plot(result, args.out)
    print(summary(result))
    print(f"wrote {path} and {', '.join(os.path.basename(p) for p in plots)}")
    return 0
