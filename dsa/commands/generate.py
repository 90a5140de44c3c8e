"""``dsa generate --prompt TEXT``: stream a completion of one prompt to stdout.

Without ``--checkpoint`` or ``--preset`` the embedded default model answers (a small trained base
model: fluent fragments, not facts). A start line (the model, dtype, device and CPU threads) and
a summary go to stderr. On a terminal, control characters other than newline and tab are shown
escaped (``\\x07``); written to a pipe or a file, the text is as generated.
"""
import sys
import time

from dsa.commands.options import add_model_arguments, add_preset_argument, add_speculative_argument, llm_from_args

# C0 and C1 control characters and DEL, but newline and tab: what a terminal would act on
CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion of --prompt to stdout")
    add_model_arguments(p)
    add_speculative_argument(p)
    add_preset_argument(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, help="0 is greedy (default: the model's generation_config.json, "
                   "0.7 for the embedded default; else 0)")
    p.add_argument("--top-p", type=float, help="default: the model's generation_config.json (0.9 for the embedded "
                   "default), else 1.0")
    p.add_argument("--top-k", type=int, help="0: no limit (default: the model's generation_config.json, else 0)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable; default: none)")
    p.set_defaults(func=run)


def escape_controls(text: str) -> str:
    """``text`` with its control characters (C0, DEL, C1; not newline or tab) written as ``\\xNN``."""
    return text.translate(CONTROLS)


def start_line(llm, checkpoint, preset=None) -> str:
    """What runs: the model (a checkpoint folder, a random-weight preset or the embedded default), its
    dtype and device, and on CPU the threads."""
    from dsa.engine.cpu_threads import describe

    model = llm.model
    if checkpoint is not None:
        what = f"checkpoint {checkpoint}"
    elif preset is not None:
        what = f"preset {preset} (random weights, the byte-level tokenizer: the text is not language)"
    else:
        c = model.config
        what = (f"embedded default (trained, {c.num_hidden_layers} layers x {c.hidden_size}, "
                f"index_topk {c.index_topk}: a small base model, fluent fragments, not facts)")
    threads = f", {describe(llm.cpu_threads, llm.cpu_threads_reason)}" if llm.cpu_threads is not None else ""
    return f"dsa generate: model: {what}; {str(model.dtype).removeprefix('torch.')} on {model.device}{threads}"


def run(args) -> int:
    from dsa.engine.sampling import SamplingParams

    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
             if v is not None}
    try:
        SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, **given)  # checked before loading
    except ValueError as e:
        raise SystemExit(f"dsa generate: {e}") from None
    llm = llm_from_args(args, "generate")
    defaults = {"temperature": 0.0, **llm.generation_defaults}  # greedy where the model says nothing
    sampling = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, **{**defaults, **given})
    print(start_line(llm, args.checkpoint, args.preset), file=sys.stderr, flush=True)
    show = escape_controls if sys.stdout.isatty() else str
    prompt = llm.chat_ids([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    t0 = time.perf_counter()
    first = None
    tokens, reason = 0, None
    for delta in llm.stream([prompt], sampling):
        if first is None:
            first = time.perf_counter()
        tokens += len(delta.token_ids)
        reason = delta.finish_reason or reason
        sys.stdout.write(show(delta.text or ""))
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    rate = f", {(tokens - 1) / (end - first):.1f} tokens/s after the first" if tokens > 1 and end > first else ""
    print(f"[{tokens} tokens, finish_reason={reason}, first token after {first - t0:.2f} s{rate}]", file=sys.stderr)
    return 0
