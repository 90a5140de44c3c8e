"""Command-line options shared by the commands: which model, where (``--device``, one line when it
cannot be used), how much cache; bad checkpoints as one line."""
import contextlib
import os

DEVICE_HELP = ("cpu, cuda or cuda:N (gpu and gpu:N mean cuda and cuda:N) (default: cuda when a CUDA device is "
               "available, else cpu)")


def add_model_arguments(p) -> None:
    p.add_argument("--checkpoint", help="a HF checkpoint folder with tokenizer.json (default: the embedded "
                   "default model, small and trained)")
    add_device_argument(p)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-blocks", type=int, help="cache blocks (default: 80%% of free GPU memory; on CPU one "
                   "request of max_position_embeddings tokens)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="rows per step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once; later ones wait "
                   "(default: %(default)s)")
    add_max_model_len_argument(p)
    add_cpu_threads_argument(p)


def add_max_model_len_argument(p) -> None:
    p.add_argument("--max-model-len", type=int, help="the longest request in tokens, prompt and output (default: "
                   "the model's max_position_embeddings); a --preset may go past it (to 1M and more: warned past "
                   "the RoPE's trained range), a checkpoint may not")


def check_max_model_len(args, command: str) -> None:
    """``--max-model-len``, when given, is at least 1 (one line, before any model is built)."""
    value = getattr(args, "max_model_len", None)
    if value is not None and value < 1:
        raise SystemExit(f"dsa {command}: --max-model-len must be at least 1, got {value}")


@contextlib.contextmanager
def max_model_len_errors(command: str):
    """Inside: a ValueError about ``max_model_len`` (a checkpoint's limit) exits with one line
    naming ``--max-model-len``."""
    try:
        yield
    except ValueError as e:
        if not str(e).startswith("max_model_len:"):
            raise
        raise SystemExit(f"dsa {command}: --max-model-len{str(e)[len('max_model_len'):]}") from None


def add_speculative_argument(p) -> None:
    p.add_argument("--speculative-tokens", type=int, default=0, help="draft N tokens a step with the model's MTP "
                   "module and verify them in one step (greedy output unchanged; no --tp, no logprobs) "
                   "(default: %(default)s: off)")


def add_preset_argument(p) -> None:
    from dsa.model.preset_names import PRESET_NAMES
    p.add_argument("--preset", choices=PRESET_NAMES, help="a random-weight preset with the byte-level tokenizer "
                   "instead of the embedded default (demo-gpu: V3.2's attention shapes, for speed; default: none)")


def add_cpu_threads_argument(p) -> None:
    p.add_argument("--cpu-threads", type=int, help="torch's threads on CPU (default: one per CPU that other "
                   "processes leave free, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set)")


def cpu_threads_from_args(args, command: str | None) -> int | None:
    """``--cpu-threads``, checked (one line when below 1)."""
    if args.cpu_threads is not None and args.cpu_threads < 1:
        prog = f"dsa {command}" if command else "dsa"
        raise SystemExit(f"{prog}: --cpu-threads must be at least 1, got {args.cpu_threads}")
    return args.cpu_threads


def add_overwrite_argument(p) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace result files that exist (default: refuse, "
                   "so that no run writes over another's, or over a committed one)")


def refuse_to_overwrite(command: str, flag: str, paths, overwrite: bool) -> None:
    """Before any work: one line naming ``flag`` when a file of ``paths`` exists, unless ``overwrite``."""
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise SystemExit(f"dsa {command}: {flag}: {existing[0]} exists; give another {flag}, or --overwrite to "
                         "replace it")


def add_device_argument(p) -> None:
    p.add_argument("--device", help=DEVICE_HELP)


def device_from_args(args, command: str):
    """``args.device`` as a ``torch.device`` (None: cuda when available, else cpu; ``gpu`` is ``cuda``),
    stored back in ``args.device`` as its name; a device that is not there exits with one line
    naming ``--device``."""
    import torch

    prog = f"dsa {command}"
    value = args.device
    name = "cuda" if value is None and torch.cuda.is_available() else "cpu" if value is None else value.strip().lower()
    if name == "gpu" or name.startswith("gpu:"):
        name = "cuda" + name[3:]
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SystemExit(f"{prog}: --device {value}: expected cpu, cuda, cuda:N, gpu or gpu:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "" if torch.version.cuda else f" (this torch, {torch.__version__}, is built without CUDA)"
            raise SystemExit(f"{prog}: --device {value}: no CUDA device is available{build}; "
                             "use --device cpu, or leave --device out")
        if device.index is not None and device.index >= count:
            raise SystemExit(f"{prog}: --device {value}: there {'is' if count == 1 else 'are'} {count} CUDA "
                             f"device{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})")
    args.device = str(device)
    return device


def llm_from_args(args, command: str):
    import torch

    from dsa.serve.llm import LLM

    device_from_args(args, command)
    check_max_model_len(args, command)

    options = {"max_batch_tokens": args.max_batch_tokens, "max_num_seqs": args.max_num_seqs,
               "cpu_threads": cpu_threads_from_args(args, command)}
    if args.num_blocks is not None:
        options["num_blocks"] = args.num_blocks
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if getattr(args, "speculative_tokens", 0):
        options["speculative_tokens"] = args.speculative_tokens
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tp_size = getattr(args, "tp", 1)
    if getattr(args, "preset", None) is not None:
        from dsa.model.presets import preset_model
        from dsa.serve.tokenizer import ByteTokenizer
        if args.checkpoint is not None:
            raise SystemExit("--preset: give --checkpoint or --preset, not both")
        model = preset_model(args.preset, args.device, dtype, tp_size=tp_size, mtp="speculative_tokens" in options)
        with max_model_len_errors(command), speculative_errors(command):
            return LLM.from_model(model, ByteTokenizer(), **options)
    with checkpoint_errors(command, args.checkpoint), max_model_len_errors(command), speculative_errors(command):
        return LLM(args.checkpoint, device=args.device, dtype=dtype, tp_size=tp_size, **options)


@contextlib.contextmanager
def speculative_errors(command: str):
    """``--speculative-tokens`` that the model or the options cannot take: one line."""
    try:
        yield
    except ValueError as e:
        if not str(e).startswith("speculative_tokens"):
            raise
        raise SystemExit(f"dsa {command}: --{e}".replace("--speculative_tokens", "--speculative-tokens")) from None


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
