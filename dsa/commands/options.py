"""Command-line options shared by ``dsa generate`` and ``dsa serve``: which model, where, how much cache;
bad checkpoints as one line."""
import contextlib
import os


def add_model_arguments(p) -> None:
    p.add_argument("--checkpoint", help="a HF checkpoint folder with tokenizer.json (default: the embedded "
                   "random-weight model with the byte-level tokenizer)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-blocks", type=int, help="cache blocks (default: 80%% of free GPU memory; on CPU one "
                   "request of max_position_embeddings tokens)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="rows per step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once; later ones wait "
                   "(default: %(default)s)")
    add_cpu_threads_argument(p)


def add_cpu_threads_argument(p) -> None:
    p.add_argument("--cpu-threads", type=int, help="torch's threads on CPU (default: one per CPU that other "
                   "processes leave free, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set)")


def cpu_threads_from_args(args, command: str | None) -> int | None:
    """``--cpu-threads``, checked (one line when below 1)."""
    if args.cpu_threads is not None and args.cpu_threads < 1:
        prog = f"dsa {command}" if command else "dsa"
        raise SystemExit(f"{prog}: --cpu-threads must be at least 1, got {args.cpu_threads}")
    return args.cpu_threads


def llm_from_args(args, command: str | None = None):
    import torch

    from dsa.serve.llm import LLM

    options = {"max_batch_tokens": args.max_batch_tokens, "max_num_seqs": args.max_num_seqs,
               "cpu_threads": cpu_threads_from_args(args, command)}
    if args.num_blocks is not None:
        options["num_blocks"] = args.num_blocks
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tp_size = getattr(args, "tp", 1)
    if getattr(args, "preset", None) is not None:
        from dsa.model.presets import preset_model
        from dsa.serve.tokenizer import ByteTokenizer
        if args.checkpoint is not None:
            raise SystemExit("--preset: give --checkpoint or --preset, not both")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return LLM.from_model(preset_model(args.preset, device, dtype, tp_size=tp_size), ByteTokenizer(), **options)
    with checkpoint_errors(command, args.checkpoint):
        return LLM(args.checkpoint, device=args.device, dtype=dtype, tp_size=tp_size, **options)


@contextlib.contextmanager
def checkpoint_errors(command: str | None, checkpoint):
    """Loading ``checkpoint`` (a folder, or None: nothing to check) inside: a missing folder or file,
    an unreadable config.json or safetensors file exits with one line naming the path (after
    ``dsa COMMAND:``)."""
    prog = f"dsa {command}" if command else "dsa"
    if checkpoint is None:
        yield
        return
    if not os.path.isdir(checkpoint):
        raise SystemExit(f"{prog}: --checkpoint {checkpoint}: no such folder")
    try:
        yield
    except (OSError, ValueError, TypeError) as e:
        detail = f"{e.filename}: no such file" if isinstance(e, FileNotFoundError) and e.filename else str(e)
        if os.fspath(checkpoint) not in detail:
            detail = f"--checkpoint {checkpoint}: {detail}"
        raise SystemExit(f"{prog}: {' '.join(detail.split())}") from None
