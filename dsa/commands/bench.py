"""``python -m dsa bench <op>``: same-run ceilings, then the op, results as JSON under benchmarks/results/.

``dsa bench serve`` is the exception: a load generator for ``dsa serve`` (no ceilings, no GPU needed).
"""
import importlib

from dsa.bench import serve as serve_bench
from dsa.commands.options import add_model_arguments

TIMED = {  # subcommand -> module with run(device, timer, ceilings, args) -> rows
    "indexer": "dsa.bench.indexer",
    "deepgemm": "dsa.bench.deepgemm",
    "topk": "dsa.bench.topk",
    "mla": "dsa.bench.mla",
    "layer": "dsa.bench.layer",
    "crossover": "dsa.bench.crossover",
    "engine": "dsa.bench.engine",
    "prefix": "dsa.bench.prefix",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks on a CUDA GPU (ceilings, kernels, layer, engine), reports, and "
                       "serve: a load generator for dsa serve")
    p.add_argument("op", choices=["ceilings", *TIMED, "render", "plot", "serve"])
    p.add_argument("--out", default="benchmarks/results", help="folder for the result JSON (default: %(default)s)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per row (median reported)")
    p.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    p.add_argument("--variants", action="store_true",
                   help="mla, indexer, topk: also time tile, split, pipeline and sample variants of the kernels")
    p.add_argument("--results", default="benchmarks/results", help="render, plot: folder of result JSON")
    p.add_argument("--figures", default="benchmarks/figures", help="plot: folder for the PNGs")
    p.add_argument("--readme", default=None, help="render: README to update between the perf markers")
    p.add_argument("--git-sha", default=None, help="record this commit (default: `git rev-parse HEAD` here)")
    g = p.add_argument_group("serve", "dsa bench serve: the server it starts (model options) and the load")
    add_model_arguments(g)
    serve_bench.add_arguments(g)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsa.bench.harness import Timer, env_info, measure_ceilings, require_cuda, write_result

    if args.op == "plot":
        from dsa.bench.plot import plot_results, require_matplotlib
        require_matplotlib("dsa bench plot")
        paths = plot_results(args.results, args.figures)
        print("wrote " + (", ".join(paths) if paths else "nothing (no result rows with a context length)"))
        return 0
    if args.op == "serve":
        return serve_bench.run(args)
    if args.op == "render":
        from dsa.bench.report import render_command
        return render_command(args.results, args.readme)
    device = require_cuda(args.op)
    env = env_info()
    if args.git_sha:
        env["git_sha"] = args.git_sha
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  git {env['git_sha'][:12]}")
    ceilings = measure_ceilings(device)
    print("ceilings: copy {copy_tbps:.2f} TB/s, bf16 {bf16_tflops:.0f} TFLOP/s (p10 {bf16_tflops_p10:.0f}), "
          "fp8 {fp8_tflops:.0f} TFLOP/s".format(**ceilings))
    rows = []
    if args.op in TIMED:
        timer = Timer(device, reps=args.reps)
        rows = importlib.import_module(TIMED[args.op]).run(device, timer, ceilings, args)
    path = write_result(args.op, rows, ceilings, env, args.out,
                        args={k: v for k, v in vars(args).items() if k != "func"})
    from dsa.bench.report import format_rows
    print(format_rows(rows))
    print(f"wrote {path}")
    return 0
