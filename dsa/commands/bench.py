"""``python -m dsa bench <op>``: same-run ceilings, then the op, results as JSON under benchmarks/results/.

Tensor parallel runs start one process per rank under torchrun (``torchrun --nproc-per-node 2 -m dsa
bench engine --tp 2``, ``torchrun --nproc-per-node 2 -m dsa bench allreduce``); rank 0 prints and
writes the file.

``dsa bench serve`` is the exception: a load generator for ``dsa serve`` (no ceilings, no GPU needed;
:mod:`dsa.commands.bench_serve`). ``render`` and ``plot`` read committed JSON (no GPU either).
``dsa bench long`` also runs on CPU (tiny shapes, no ceilings: a smoke run), and writes a figure
beside its JSON.
"""
import importlib
import os
import shlex

from dsa.bench.report import format_rows, load_results, render_markdown, tp_compare, update_readme
from dsa.commands import bench_serve
from dsa.commands.options import add_model_arguments, add_overwrite_argument, device_from_args, refuse_to_overwrite

TIMED = {  # subcommand -> module with run(device, timer, ceilings, args) -> rows
    "indexer": "dsa.bench.indexer",
    "deepgemm": "dsa.bench.deepgemm",
    "topk": "dsa.bench.topk",
    "mla": "dsa.bench.mla",
    "layer": "dsa.bench.layer",
    "crossover": "dsa.bench.crossover",
    "engine": "dsa.bench.engine",
    "prefix": "dsa.bench.prefix",
    "allreduce": "dsa.bench.allreduce",
    "long": "dsa.bench.long",
}
DISTRIBUTED = ("allreduce",)  # ops that run under torchrun only
ON_CPU = ("long",)  # ops that also run on CPU (no ceilings there)
FIGURED = ("long",)  # ops whose module writes a figure beside the JSON (write_figure)
LENGTHS = "131072,262144,524288,1048576"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on a CUDA GPU (ceilings, kernels, layer, engine), reports, and "
                       "serve: a load generator for dsa serve")
    p.add_argument("op", choices=["ceilings", *TIMED, "render", "plot", "serve"])
    p.add_argument("--out", default="out/bench", help="folder for the result JSON (default: %(default)s; the "
                   "committed ones are in benchmarks/results)")
    add_overwrite_argument(p)
    p.add_argument("--reps", type=int, default=30, help="timed calls per row (median reported) "
                   "(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--variants", action="store_true",
                   help="mla, indexer, topk: also time tile, split, pipeline and sample variants of the kernels")
    p.add_argument("--tp", type=int, default=1, help="engine: tensor-parallel ranks, one process each: "
                   "torchrun --nproc-per-node N -m dsa bench engine --tp N (default: %(default)s)")
    p.add_argument("--speculative-tokens", type=int, default=0, help="engine: decode with N draft tokens a step "
                   "against plain decoding, B = 1 (--checkpoint, default the embedded model's MTP module; or "
                   "--preset with a random one) (default: %(default)s: the plain engine rows)")
    p.add_argument("--draft-acceptance", type=float, help="engine --speculative-tokens: draft with the test "
                   "drafter instead, each draft right with this probability (default: the MTP module)")
    p.add_argument("--spec-batch", default="1", help="engine --speculative-tokens: batch sizes, comma-separated "
                   "(default: %(default)s)")
    p.add_argument("--tp-compare", action="store_true",
                   help="render: print the newest TP=1 and TP=N engine results side by side")
    p.add_argument("--results", default="benchmarks/results", help="render, plot: folder of result JSON "
                   "(default: %(default)s)")
    p.add_argument("--figures", default="benchmarks/figures", help="plot: folder for the PNGs (default: %(default)s)")
    p.add_argument("--readme", default=None, help="render: README to update between the perf markers")
    p.add_argument("--git-sha", default=None, help="record this commit (default: what git rev-parse HEAD says here)")
    p.add_argument("--lengths", default=LENGTHS, help="long: prompt tokens of each row, comma-separated "
                   "(default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="long: tokens each request decodes (default: "
                   "%(default)s)")
    p.add_argument("--dense-up-to", type=int, default=131072, help="long: also run the dense path (the same "
                   "weights without the indexer) at the lengths up to this (default: %(default)s)")
    g = p.add_argument_group("serve", "dsa bench serve: the server it starts (model options) and the load")
    add_model_arguments(g)
    bench_serve.add_arguments(g)
    p.set_defaults(func=run)


def check_ranks(args) -> None:
    """One-line refusals of ``--tp`` and of the torchrun-only ops, before any GPU work."""
    what = f"dsa bench {args.op}"
    if args.tp < 1:
        raise SystemExit(f"{what}: --tp must be a positive number, got {args.tp}")
    if args.tp > 1 and args.op != "engine":
        raise SystemExit(f"{what}: --tp applies to `dsa bench engine` only")
    if args.speculative_tokens < 0 or (args.speculative_tokens and (args.op != "engine" or args.tp > 1)):
        raise SystemExit(f"{what}: --speculative-tokens: expected N >= 0, with `dsa bench engine` at --tp 1")
    if args.draft_acceptance is not None and not (args.speculative_tokens and 0 <= args.draft_acceptance <= 1):
        raise SystemExit(f"{what}: --draft-acceptance: expected a probability in [0, 1], with --speculative-tokens")
    batches = args.spec_batch.split(",")
    if not all(b.isdigit() and int(b) >= 1 for b in batches) or (args.spec_batch != "1" and not args.speculative_tokens):
        raise SystemExit(f"{what}: --spec-batch: expected batch sizes >= 1, comma-separated, with --speculative-tokens; "
                         f"got {args.spec_batch!r}")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.op in DISTRIBUTED and (not under_torchrun or world < 2):
        raise SystemExit(f"{what}: needs 2 or more ranks, one process each: "
                         f"`torchrun --nproc-per-node 2 -m dsa bench {args.op}`")
    if args.tp > 1 and not under_torchrun:
        raise SystemExit(f"{what}: --tp {args.tp} needs one process per rank: "
                         f"`torchrun --nproc-per-node {args.tp} -m dsa bench {args.op} --tp {args.tp}`")
    if getattr(args, "max_model_len", None) is not None and args.op not in ("long", "serve"):
        raise SystemExit(f"{what}: --max-model-len applies to `dsa bench long` and `dsa bench serve` only")
    if under_torchrun and args.op not in DISTRIBUTED and world != args.tp:
        raise SystemExit(f"{what}: --tp {args.tp} but torchrun started {world} ranks" if args.op == "engine" else
                         f"{what}: runs in one process, but torchrun started {world} ranks")


def command_line(args) -> str:
    """The command that made a result file, as it would be typed."""
    argv = " ".join(shlex.quote(a) for a in getattr(args, "argv", []))
    if "RANK" in os.environ:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
        return f"torchrun --nproc-per-node {per_node} -m dsa {argv}"
    return f"python -m dsa {argv}"


def require_cuda(what: str):
    """The CUDA device timing runs on; one line when none is visible."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"dsa bench {what}: timing needs a CUDA GPU and none is visible "
                         "(`dsa bench render` and `dsa bench plot` work without one)")
    return torch.device("cuda")


def run(args) -> int:
    if args.op == "plot":
        return plot(args)
    if args.op == "serve":
        return bench_serve.run(args)
    if args.op == "render":
        return render(args)
    return timed(args)


def plot(args) -> int:
    from dsa.bench.plot import FIGURES, plot_results
    from dsa.report import require_matplotlib

    require_matplotlib("dsa bench plot")
    refuse_to_overwrite("bench plot", "--figures", [os.path.join(args.figures, n) for n in FIGURES], args.overwrite)
    paths = plot_results(args.results, args.figures)
    print("wrote " + (", ".join(paths) if paths else "nothing (no result rows with a context length)"))
    return 0


def render(args) -> int:
    """The README tables of the newest result of each op (into ``--readme`` between its perf markers,
    else printed), or with ``--tp-compare`` the TP=1 and TP=N engine results side by side."""
    docs = load_results(args.results)
    if args.tp_compare:
        text = tp_compare(docs)
        if not text:
            raise SystemExit(f"dsa bench render --tp-compare: no engine-tpN result file in {args.results}")
        print(text)
        return 0
    markdown = render_markdown(docs)
    if args.readme:
        update_readme(args.readme, markdown)
        print(f"updated {args.readme}")
    else:
        print(markdown)
    return 0


def check_long(args) -> None:
    """``dsa bench long``'s sizes, one line each, before any work."""
    from dsa.bench.long import parse_lengths

    try:
        args.lengths = parse_lengths(args.lengths)
    except ValueError as e:
        raise SystemExit(f"dsa bench long: {e}") from None
    for flag, value in (("--new-tokens", args.new_tokens), ("--dense-up-to", args.dense_up_to),
                        ("--max-batch-tokens", args.max_batch_tokens), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise SystemExit(f"dsa bench long: {flag} must be at least 1, got {value}")
    need = max(args.lengths) + args.new_tokens
    if args.max_model_len is not None and args.max_model_len < need:
        raise SystemExit(f"dsa bench long: --max-model-len {args.max_model_len} is less than the longest length "
                         f"plus --new-tokens ({need})")


def bench_device(args):
    """The device the op runs on: CUDA (one line when none is visible), or for the ops that also
    run on CPU, ``--device`` (default: cuda when available)."""
    if args.op in ON_CPU:
        return device_from_args(args, f"bench {args.op}")
    return require_cuda(args.op)


def timed(args) -> int:
    """Same-run ceilings (on CUDA), then the op's rows (``ceilings`` alone: none), written by rank 0."""
    import platform

    from dsa.bench.harness import Timer, gpu_slug, measure_ceilings, result_path, write_result
    from dsa.report import env_info

    check_ranks(args)
    if args.op == "long":
        check_long(args)
    device = bench_device(args)
    if "LOCAL_RANK" in os.environ:  # torchrun: this rank's GPU, before anything allocates
        import torch
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank0 = os.environ.get("RANK", "0") == "0"
    say = print if rank0 else (lambda *a, **k: None)  # noqa: E731
    env = env_info()
    if args.git_sha:
        env["git_sha"] = args.git_sha
    if device.type == "cpu":
        env.update(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count())
    op = args.op if args.tp == 1 else f"{args.op}-tp{args.tp}"
    if args.speculative_tokens:
        op = f"{op}-spec{args.speculative_tokens}"
    path = result_path(op, env, args.out)
    if rank0:
        refuse_to_overwrite(f"bench {args.op}", "--out", [path] + (
            [os.path.join(args.out, f"dispatch_{gpu_slug(env['gpu'])}.json")] if args.op == "crossover" else []) + (
            [os.path.splitext(path)[0] + ".png"] if args.op in FIGURED else []), args.overwrite)
    say(f"{env.get('gpu', 'cpu')}  torch {env['torch']}  triton {env['triton']}  git {env['git_sha'][:12]}")
    ceilings = {}
    if device.type == "cuda":
        ceilings = measure_ceilings(device)
        say("ceilings: copy {copy_tbps:.2f} TB/s, bf16 {bf16_tflops:.0f} TFLOP/s (p10 {bf16_tflops_p10:.0f}), "
            "fp8 {fp8_tflops:.0f} TFLOP/s".format(**ceilings))
    rows = []
    if args.op in TIMED:
        timer = Timer(device, reps=args.reps) if device.type == "cuda" else None
        rows = importlib.import_module(TIMED[args.op]).run(device, timer, ceilings, args)
    if not rank0:
        return 0
    path = write_result(op, rows, ceilings, env, args.out,
                        args={**{k: v for k, v in vars(args).items() if k not in ("func", "argv")},
                              "command_line": command_line(args)})
    print(format_rows(rows))
    print(f"wrote {path}")
    if args.op in FIGURED and rows:
        write_figure(importlib.import_module(TIMED[args.op]), path, rows, env)
    return 0


def write_figure(module, path: str, rows: list, env: dict) -> None:
    """The op's figure beside its JSON, or a line saying why there is none (no matplotlib)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("no figure: matplotlib is not installed (pip install matplotlib)")
        return
    print(f"wrote {module.write_figure(path, rows, env)}")
