"""``python -m dsa demo``: generate on the embedded default model and report speed and cache bytes.

The model: :func:`dsa.model.presets.default_model` (small and trained); its prompt is held-out text
(two State of the Union addresses, 2015-2016, never trained on: ``dsa/data/demo_prompt.txt``), 16K
tokens on a GPU and 4K on CPU, and the continuation is printed. ``--preset`` runs a random-weight
preset on random token ids instead (``demo-gpu``: V3.2's attention shapes, the performance run). The
prompt is prefilled in chunks of ``--max-batch-tokens`` (default: an eighth of it), so progress shows.
"""
import dataclasses
import json
import time

from dsa.commands.options import (
    add_cpu_threads_argument,
    add_device_argument,
    add_max_model_len_argument,
    add_overwrite_argument,
    add_preset_argument,
    check_max_model_len,
    checkpoint_errors,
    cpu_threads_from_args,
    device_from_args,
    max_model_len_errors,
    refuse_to_overwrite,
)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="generate on an embedded default model (or --checkpoint) and report speed")
    p.add_argument("--checkpoint", help="a HF checkpoint folder (deepseek_v32, glm_moe_dsa, deepseek_v3)")
    add_preset_argument(p)
    p.add_argument("--context", type=int, help="prompt tokens (default: 4096 on CPU; on a GPU 16384 minus "
                   "--new-tokens for the embedded default, 32768 for a preset or checkpoint; at most what the "
                   "model's max_position_embeddings, or --max-model-len, leaves)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="requests generated together (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, help="rows per step, the prefill chunk (default: an eighth of "
                   "the prompt, rounded up to a block, at most 8192)")
    add_max_model_len_argument(p)
    add_device_argument(p)
    add_cpu_threads_argument(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one process each: start with "
                   "torchrun --nproc-per-node N -m dsa demo --tp N (default: %(default)s)")
    p.add_argument("--json", help="also write the results to this JSON file (default: none)")
    add_overwrite_argument(p)
    p.set_defaults(func=run)


def build_model(args, device):
    import torch

    from dsa.model import DSAModel
    from dsa.model.presets import default_model, preset_model
    if args.checkpoint and args.preset:
        raise SystemExit("dsa demo: --preset: give --checkpoint or --preset, not both")
    if args.checkpoint:
        with checkpoint_errors("demo", args.checkpoint):
            return DSAModel.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device=device, tp_size=args.tp)
    if args.preset:
        return preset_model(args.preset, device, tp_size=args.tp)
    return default_model(device, tp_size=args.tp)


def held_out_prompt(tokens: int) -> tuple:
    """``(ids, tokenizer)``: the first ``tokens`` ids of ``dsa/data/demo_prompt.txt`` under the embedded
    default's tokenizer (the text repeated when it is shorter)."""
    import os

    from dsa.model.presets import DEFAULT_CHECKPOINT
    from dsa.serve.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    with open(os.path.join(os.path.dirname(DEFAULT_CHECKPOINT), "demo_prompt.txt"), encoding="utf-8") as f:
        ids = tok.encode(f.read())
    return (ids * (tokens // len(ids) + 1))[:tokens], tok


@dataclasses.dataclass
class Timed:
    """What :func:`generate` measured: the two phases' seconds, the tokens decoded after the prefill
    (those sampled in the prefill's last step excluded) and the first request's continuation."""
    prefill_s: float
    decode_s: float
    decode_tokens: int
    continuation: list


def run(args) -> int:
    from dsa.engine.cpu_threads import apply_cpu_threads

    device = device_from_args(args, "demo")
    refuse_to_overwrite("demo", "--json", [args.json] if args.json else [], args.overwrite)
    check_sizes(args)
    check_max_model_len(args, "demo")
    cpu_threads = cpu_threads_from_args(args, "demo")
    threads = apply_cpu_threads(cpu_threads) if device.type == "cpu" or cpu_threads is not None else None
    t0 = time.perf_counter()
    model = build_model(args, device)
    load_s = time.perf_counter() - t0
    if args.max_model_len is not None:
        with max_model_len_errors("demo"):
            model.set_max_model_len(args.max_model_len)  # a preset's raised, a checkpoint's refused
    context = demo_context(args, device, args.max_model_len or model.config.max_position_embeddings)
    prompts, tokenizer = demo_prompts(args, model.config, context)
    engine = build_engine(args, model, device, context, tokenizer)
    quiet = model.tp.rank != 0  # under tensor parallelism rank 0 reports
    sampling = demo_sampling(args)
    timed = generate(engine, prompts, args.new_tokens, device, quiet, sampling)
    if quiet:
        return 0
    result = results(args, device, model, engine, context, load_s, threads, timed)
    report(result, model, engine, threads, timed)
    if tokenizer is not None:
        result["continuation"] = tokenizer.decode(timed.continuation)
        result["sampling"] = sampling
        show_continuation(tokenizer, prompts[0], result["continuation"], describe_sampling(sampling))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def check_sizes(args) -> None:
    """``--context`` (when given) and the other sizes are positive."""
    for flag, value in (("--context", args.context), ("--new-tokens", args.new_tokens), ("--batch", args.batch),
                        ("--max-batch-tokens", args.max_batch_tokens)):
        if value is not None and value < 1:
            raise SystemExit(f"dsa demo: {flag} must be a positive number, got {value}")


def demo_context(args, device, max_positions: int) -> int:
    """The prompt length: ``--context``, else the default for the model and device (16384 minus
    ``--new-tokens`` for the embedded default on a GPU, 32768 for a preset or checkpoint, 4096 on CPU),
    at most what ``max_positions`` (``--max-model-len``, else the model's ``max_position_embeddings``)
    leaves after ``--new-tokens``."""
    room = max_positions - args.new_tokens
    limit = (f"--max-model-len {max_positions}" if getattr(args, "max_model_len", None)
             else f"the model's max_position_embeddings {max_positions}")
    if args.context is not None:
        if args.context > room:
            raise SystemExit(f"dsa demo: --context: {args.context} + --new-tokens {args.new_tokens} exceed "
                             f"{limit}")
        return args.context
    trained = not (args.checkpoint or args.preset)
    default = (16384 - args.new_tokens if trained else 32768) if device.type == "cuda" else 4096
    if room < 1:
        raise SystemExit(f"dsa demo: --new-tokens: {args.new_tokens} leave no prompt within {limit}")
    return min(default, room)


def demo_prompts(args, cfg, context: int) -> tuple:
    """``(prompts, tokenizer)``: ``--batch`` copies of the held-out text for the embedded default, else
    ``--batch`` random prompts (seeded) and no tokenizer."""
    import torch

    if not (args.checkpoint or args.preset):
        prompt, tokenizer = held_out_prompt(context)
        return [prompt] * args.batch, tokenizer
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist() for _ in range(args.batch)], None


def build_engine(args, model, device, context: int, tokenizer):
    """An engine with cache for exactly the batch, prefilling ``--max-batch-tokens`` rows a step;
    on a GPU warmed up (every kernel compiled, the decode graphs captured) before anything is timed."""
    from dsa.engine import Engine
    from dsa.kernels.common import cdiv

    cfg = model.config
    per_request = cdiv(context + args.new_tokens, cfg.block_size)
    chunk = args.max_batch_tokens or min(8192, cdiv(context * args.batch, 8 * cfg.block_size) * cfg.block_size)
    engine = Engine(model, num_blocks=per_request * args.batch, max_batch_tokens=chunk, tokenizer=tokenizer,
                    max_model_len=args.max_model_len)
    if device.type == "cuda":
        report = engine.warmup(progress=not model.tp.rank)
        if not model.tp.rank:
            print(f"warm-up: {report['seconds']} s, {report['graphs_captured']} CUDA graphs")
    return engine


def demo_sampling(args) -> dict:
    """The demo's sampling: the checkpoint's ``generation_config.json`` defaults with seed 0 (the embedded
    default: temperature 0.7, top-p 0.9), greedy for a random-weight preset or a checkpoint without them."""
    from dsa.model.presets import DEFAULT_CHECKPOINT
    from dsa.serve.llm import generation_defaults

    if args.preset:
        return {"temperature": 0.0}
    defaults = generation_defaults(args.checkpoint or DEFAULT_CHECKPOINT)
    return {**defaults, "seed": 0} if defaults else {"temperature": 0.0}


def describe_sampling(sampling: dict) -> str:
    """``greedy`` or ``temperature 0.7, top_p 0.9, seed 0``."""
    if sampling.get("temperature", 1.0) == 0:
        return "greedy"
    return ", ".join(f"{k} {v}" for k, v in sampling.items())


def generate(engine, prompts: list, new_tokens: int, device, quiet: bool, sampling: dict) -> Timed:
    """Generate exactly ``new_tokens`` tokens for each prompt with ``sampling`` (SamplingParams fields),
    with one progress bar per phase so that each shows its own rate. Prefill: each step timed
    (synchronized) while a prompt chunk remains; decode: the rest timed as a whole, the host running ahead
    of the GPU."""
    import torch
    from tqdm import tqdm

    from dsa.engine import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **sampling)  # exactly N tokens
    first = [engine.add_request(p, sampling=sampling) for p in prompts][0]
    continuation = []

    def step() -> int:
        out = engine.step()
        continuation.extend(out.get(first, ()))
        return sum(len(v) for v in out.values())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    prefill_bar = tqdm(total=sum(len(p) for p in prompts), unit="tok", desc="prefill", disable=quiet)
    prefill_s = 0.0
    produced_in_prefill = 0
    while engine.waiting or any(r.prefilling for r in engine.running.values()):
        tokens = engine.stats.tokens
        sync()
        t = time.perf_counter()
        produced_in_prefill += step()
        sync()
        prefill_s += time.perf_counter() - t
        prefill_bar.update(engine.stats.tokens - tokens)
    prefill_bar.close()
    decode_tokens = len(prompts) * new_tokens - produced_in_prefill
    decode_bar = tqdm(total=decode_tokens, unit="tok", desc="decode", disable=quiet)
    t = time.perf_counter()
    while engine.has_work():
        decode_bar.update(step())
    sync()
    decode_s = time.perf_counter() - t
    decode_bar.close()
    return Timed(prefill_s, decode_s, decode_tokens, continuation)


def results(args, device, model, engine, context: int, load_s: float, threads, timed: Timed) -> dict:
    """The run's record, as ``--json`` writes it (the continuation is added by :func:`run`)."""
    import torch

    from dsa.config import bytes_per_token, indexer_layers, latent_format
    from dsa.report import env_info

    cfg = model.config
    prefill_tokens = args.batch * context
    return {
        "env": env_info(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "index_heads": cfg.index_n_heads, "index_topk": cfg.index_topk, "dtype": str(model.dtype),
                  "latent_cache": latent_format(cfg, model.dtype), "checkpoint": args.checkpoint},
        "batch": args.batch, "context": context, "new_tokens": args.new_tokens,
        "max_batch_tokens": engine.max_batch_tokens,
        "load_s": load_s, "cpu_threads": None if threads is None else threads[0],
        "prefill_tokens_per_s": prefill_tokens / timed.prefill_s if timed.prefill_s else None,
        "decode_tokens_per_s": timed.decode_tokens / timed.decode_s if timed.decode_s else None,
        "cache_bytes_per_token_dsa": bytes_per_token(cfg, model.dtype),
        "cache_bytes_per_token_dense_mla": bytes_per_token(cfg.replace(index_topk=None), model.dtype),
        "indexer_layers": len(indexer_layers(cfg)), "layers": cfg.num_hidden_layers,
        "rows": engine.stats.rows, "prefill_chunks": engine.stats.prefill_chunks, "tp_size": model.tp.size,
        "graph_steps": engine.stats.graph_steps,
        "allreduce": model.tp.reducer.describe() if model.tp.reducer is not None else None,
    }


def report(result: dict, model, engine, threads, timed: Timed) -> None:
    """The human-readable lines: the model and device, the two phases' rates, cache bytes and rows."""
    from dsa.engine.cpu_threads import describe

    cfg = model.config
    print(f"device {result['device']}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, index_topk {cfg.index_topk}, {model.dtype}"
          + (f", tensor parallel over {model.tp.size} ranks" if model.tp.size > 1 else "")
          + (f", {describe(*threads)}" if threads else ""))
    if model.tp.reducer is not None:
        print(f"all-reduce: {model.tp.reducer.path} ({model.tp.reducer.reason})")
    prefill_tokens = result["batch"] * result["context"]
    print(f"prefill: {prefill_tokens} tokens in {timed.prefill_s:.2f} s = {result['prefill_tokens_per_s']:.0f} "
          "tokens/s")
    if timed.decode_s:
        graphs = engine.stats.graph_steps
        replayed = f" ({graphs} steps replayed from CUDA graphs)" if graphs else ""
        print(f"decode:  {timed.decode_tokens} tokens in {timed.decode_s:.2f} s = "
              f"{result['decode_tokens_per_s']:.1f} tokens/s{replayed}")
    dsa_bytes, dense_bytes = result["cache_bytes_per_token_dsa"], result["cache_bytes_per_token_dense_mla"]
    print(f"cache bytes per token: {dsa_bytes} with DSA vs {dense_bytes} for dense MLA "
          f"(+{100 * (dsa_bytes - dense_bytes) / dense_bytes:.1f}% for the indexer keys)")
    print(f"layers running the indexer: {result['indexer_layers']} of {cfg.num_hidden_layers}")
    print("rows served: " + ", ".join(f"{k} {v}" for k, v in engine.stats.rows.items() if v))


def show_continuation(tokenizer, prompt: list, continuation: str, how: str) -> None:
    from dsa.commands.generate import escape_controls

    print(f"prompt: ...{escape_controls(tokenizer.decode(prompt[-24:]))!r}")
    print(f"continuation ({how}): {escape_controls(continuation)!r}")
