"""``dsa bench serve``: the load generator's options and their checks, and the run: start ``dsa serve``
(or reach ``--url``), send the plan (:mod:`dsa.bench.serve`) or the soak mix (:mod:`dsa.bench.soak`),
write the result file and print the summary.

Building the options imports no torch and no httpx (``dsa --help`` answers at once); :func:`run`
imports the load generator."""
import asyncio
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass

from dsa.commands.options import device_from_args, refuse_to_overwrite
from dsa.model.preset_names import PRESET_NAMES


def add_arguments(g) -> None:
    """The serve bench's options (the model options come from ``dsa.commands.options``)."""
    g.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000); default: start "
                   "dsa serve on a free loopback port")
    g.add_argument("--preset", choices=PRESET_NAMES, help="the started server's random-weight preset "
                   "(default: the embedded default model)")
    g.add_argument("--api-key", default=os.environ.get("DSA_API_KEY"), help="the server's key (default: "
                   "$DSA_API_KEY)")
    g.add_argument("--num-requests", type=int, default=64, help="requests to send (default: %(default)s)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default: "
                   "%(default)s)")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second "
                   "(default: %(default)s, each request when a slot frees)")
    g.add_argument("--concurrency-range", type=int, nargs=2, metavar=("A", "B"), help="bursts of a uniform "
                   "A..B requests sent at once, each after the last finished")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    g.add_argument("--input-len-range", type=int, nargs=2, metavar=("A", "B"), help="prompt tokens drawn "
                   "uniformly from A..B per request")
    g.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: %(default)s)")
    g.add_argument("--max-tokens-range", type=int, nargs=2, metavar=("A", "B"), help="max_tokens drawn "
                   "uniformly from A..B per request")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (every output max_tokens long)")
    g.add_argument("--dataset", help="a text file; prompts are random spans of it (default: random words)")
    g.add_argument("--tokenizer", help="tokenizer folder for prompt lengths (default: the checkpoint's, "
                   "else the byte-level one of the embedded model and presets)")
    g.add_argument("--shared-prefix", type=int, metavar="N", help="groups of N questions on one document "
                   "of --input-len tokens, a group sent at once")
    g.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default: %(default)s)")
    g.add_argument("--soak", action="store_true", help="a seeded mix (streamed, plain, chats, client drops, bad "
                   "requests, stop strings, large max_tokens) in bursts up to twice --concurrency, then checks "
                   "that nothing was lost, nothing leaked and memory stayed flat (dsa.bench.soak)")
    g.add_argument("--json", help="result file (default: <--out>/serve-<gpu or cpu>-<date>.json)")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds the started server gets to "
                   "answer /health (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait for "
                   "a chunk (default: %(default)s)")


def check_args(args) -> None:
    """One-line errors naming the argument."""
    def fail(msg):
        raise SystemExit(f"dsa bench serve: {msg}")
    for name in ("num_requests", "concurrency", "input_len", "max_tokens", "shared_prefix"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')}: expected at least 1, got {value}")
    if not args.request_rate > 0:
        fail(f"--request-rate: expected a positive rate, got {args.request_rate}")
    for name in ("input_len_range", "max_tokens_range", "concurrency_range"):
        r = getattr(args, name)
        if r is not None and not 1 <= r[0] <= r[1]:
            fail(f"--{name.replace('_', '-')}: expected 1 <= A <= B, got {r[0]} {r[1]}")
    if args.url and (args.preset or args.checkpoint):
        fail("--url: a running server; --preset and --checkpoint are for the one this command starts")
    if args.preset and args.checkpoint:
        fail("--preset: give --checkpoint or --preset, not both")
    if args.shared_prefix and (args.concurrency_range or args.dataset or args.input_len_range):
        fail("--shared-prefix: not with --concurrency-range, --dataset or --input-len-range")
    if args.request_rate != float("inf") and (args.shared_prefix or args.concurrency_range):
        fail("--request-rate: not with --shared-prefix or --concurrency-range (they send bursts)")
    if args.dataset and not os.path.isfile(args.dataset):
        fail(f"--dataset: {args.dataset} is not a file")


def device_slug(args) -> str:
    """The result file's machine tag: the GPU's (a started server on cuda), else ``cpu``."""
    import torch

    from dsa.bench.harness import gpu_slug
    device = args.device if args.url is None else None
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return gpu_slug(torch.cuda.get_device_name())
    return "cpu"


def result_path(args, date: str) -> str:
    """``--json``, else ``<--out>/{serve,soak}-<gpu or cpu>-<date>.json``."""
    return args.json or os.path.join(args.out, f"{'soak' if args.soak else 'serve'}-{device_slug(args)}-{date}.json")


@dataclass
class Traffic:
    """What one run sent and measured."""
    model: str  # the server's model id (its /v1/models)
    rows: list  # one per request, in plan order
    duration: float  # seconds from the first send to the last finish
    compiles: float | None  # kernel compiles after ready (None: the server does not export the counter)
    marks: list | None = None  # the soak's gauges at soak.SAMPLES points of its plan
    end: dict | None = None  # the soak's gauges once the server is idle after it


def run(args) -> int:
    from dsa.bench import serve, soak
    from dsa.report import env_info

    if args.url is None:  # the server it starts runs there
        device_from_args(args, "bench serve")
    env = env_info()
    path = result_path(args, env["date"])
    refuse_to_overwrite("bench serve", "--json" if args.json else "--out", [path], args.overwrite)
    check_args(args)
    tok = serve.load_tokenizer(args)
    plan = soak.soak_plan(args, tok) if args.soak else serve.build_plan(args, tok)
    started = None if args.url else serve.StartedServer(args)
    url = (args.url or started.url).rstrip("/")
    try:
        traffic = send_traffic(url, plan, args)
    except BaseException:
        if started is not None:
            started.stop()
            print(f"the server's log: {started.log.name}", file=sys.stderr)
        raise
    rows = traffic.rows
    failed = sum(r["outcome"] == "lost" for r in rows) if args.soak else sum(r["error"] is not None for r in rows)
    if started is not None:
        started.stop(keep_log=failed > 0)
        if failed:
            print(f"the server's log: {started.log.name}")
    server = {"url": url, "started": started is not None, "model": traffic.model,
              "ready_s": None if started is None else started.ready_s,
              "kernel_compiles_after_ready": traffic.compiles}
    given = {k: (None if v == float("inf") else v) for k, v in vars(args).items() if k != "func"}
    if args.soak:
        summary = soak.soak_summary(rows, traffic.marks, traffic.end)
        write_doc(path, {"op": "serve-soak", "env": env, "args": given, "server": server,
                         "duration_s": traffic.duration, "summary": summary, "rows": rows})
        print_soak(summary, server, traffic.duration)
        print(f"wrote {path}")
        if importlib.util.find_spec("matplotlib") is not None:
            print(f"wrote {soak.plot_memory(summary, os.path.splitext(path)[0] + '-memory.png')}")
        return 0 if summary["ok"] else 1
    summary = serve.summarize(rows, traffic.duration, args)
    if args.ignore_eos and summary["short_outputs"]:
        print(f"warning: --ignore-eos: {summary['short_outputs']} requests ended before max_tokens")
    write_doc(path, {"op": "serve", "env": env, "args": given, "server": server, "summary": summary,
                     "rows": [{"index": i, "burst": p["burst"], **{k: v for k, v in r.items() if k != "usage"}}
                              for i, (p, r) in enumerate(zip(plan, rows))]})
    print_summary(summary, server)
    print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1


def send_traffic(url: str, plan: list, args) -> Traffic:
    """Ask the server its model (one line naming --url when it does not answer), then send the plan or
    the soak mix, reading the kernel-compile counter before and after."""
    import httpx

    from dsa.bench import serve, soak

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=30.0) as client:
        try:
            r = client.get(url + "/v1/models")
        except httpx.HTTPError as e:
            raise SystemExit(f"dsa bench serve: --url: {url} does not answer ({type(e).__name__}: {e})") from None
        if r.status_code != 200:
            raise SystemExit(f"dsa bench serve: {url}/v1/models answered HTTP {r.status_code} "
                             f"(a key? --api-key): {r.text[:200]}")
        model = r.json()["data"][0]["id"]
        before = serve.read_compiles(client, url)
        marks = end = None
        if args.soak:
            t0 = time.perf_counter()
            rows, marks = asyncio.run(soak.soak_run(url, args.api_key, model, plan, args))
            duration = time.perf_counter() - t0
            end = soak.settled_gauges(url, args.api_key)
        else:
            rows, duration = asyncio.run(serve.run_plan(url, args.api_key, model, plan, args))
        after = serve.read_compiles(client, url)
    return Traffic(model, rows, duration, None if before is None or after is None else after - before, marks, end)


def write_doc(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def print_summary(s: dict, server: dict) -> None:
    def ms(d):
        return "  ".join(f"{k} {1e3 * v:.1f}" if v is not None else f"{k} -" for k, v in d.items())
    if server["ready_s"] is not None:
        print(f"server ready in {server['ready_s']:.1f} s")
    print(f"requests {s['completed']}/{s['requests']} ok, {s['failed']} failed in {s['duration_s']:.2f} s "
          f"({s['requests_per_s'] or 0:.2f} req/s)")
    print(f"tokens in {s['input_tokens']}, out {s['output_tokens']} ({s['tokens_from']}); output "
          f"{s['output_tokens_per_s'] or 0:.1f} tok/s, total {s['total_tokens_per_s'] or 0:.1f} tok/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        print(f"{name[:-2].upper():5} ms: {ms(s[name])}")
    print(f"kernel compiles after ready: {server['kernel_compiles_after_ready']}")
    for e in s["errors"]:
        print(f"error: {e}")


def print_soak(summary: dict, server: dict, duration: float) -> None:
    outcomes = {}
    for kinds in summary["by_kind"].values():
        for k, v in kinds.items():
            outcomes[k] = outcomes.get(k, 0) + v
    print(f"soak: {summary['requests']} requests in {duration:.1f} s: " + ", ".join(f"{k} {v}" for k, v in
                                                                                  sorted(outcomes.items())))
    print(f"lost {summary['lost']}; held after: {summary['leaked']}; memory growth since half-way: "
          + ", ".join(f"{k} {v / 2**20:+.1f} MiB" for k, v in summary["memory_growth_bytes"].items())
          + f" (bound {summary['memory_bound_bytes'] / 2**20:.0f} MiB); kernel compiles after ready: "
          f"{server['kernel_compiles_after_ready']}")
    trace = [m.get("process_resident_memory_bytes") for m in summary["memory_trace"]]
    if all(v is not None for v in trace):
        print(f"resident memory at {len(trace)} points: " + ", ".join(f"{v / 2**20:.0f}" for v in trace) + " MiB")
    k, k_full = summary["rss_slope_bytes_per_request"], summary["rss_slope_after_full"]
    print("resident memory slope over the second half: " + ("n/a" if k is None else f"{k:,.0f} B/request")
          + f"; pool full at request {summary['pool_full_at']}"
          + ("" if k_full is None else f", slope after it {k_full:,.0f} B/request")
          + f"; gen-2 collections {summary['gc_gen2_collections']}, longest pause "
          f"{1e3 * summary['gc_longest_pause_s']:.1f} ms")
