"""``dsa generate --prompt TEXT``: stream a completion of one prompt to stdout.

Without ``--checkpoint`` the embedded default model answers (random weights and the byte-level
tokenizer: the text is not language). A summary goes to stderr.
"""
import sys
import time

from dsa.commands.options import add_model_arguments, llm_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion of --prompt to stdout")
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    p.add_argument("--top-k", type=int, default=0, help="0: no limit (default: %(default)s)")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable; default: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsa.engine.sampling import SamplingParams

    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop)
    except ValueError as e:
        raise SystemExit(f"dsa generate: {e}") from None
    llm = llm_from_args(args, "generate")
    prompt = llm.chat_ids([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    t0 = time.perf_counter()
    first = None
    tokens, reason = 0, None
    for delta in llm.stream([prompt], sampling):
        if first is None:
            first = time.perf_counter()
        tokens += len(delta.token_ids)
        reason = delta.finish_reason or reason
        sys.stdout.write(delta.text or "")
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    rate = f", {(tokens - 1) / (end - first):.1f} tokens/s after the first" if tokens > 1 and end > first else ""
    print(f"[{tokens} tokens, finish_reason={reason}, first token after {first - t0:.2f} s{rate}]", file=sys.stderr)
    return 0
