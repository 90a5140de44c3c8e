"""Turn committed benchmark JSON into text and README tables (no GPU needed)."""
import glob
import json
import os

from dsa.errors import DSAError

BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"


def _shape(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def target(row: dict) -> tuple[str, bool | None]:
    """The row's targets as text and whether this run met all of them (None: no target); time
    targets are checked against the graph-replay time where the row has one."""
    parts = []  # (text, met)
    if row.get("target_us") is not None:
        parts.append((f"<= {row['target_us']:.0f} us", row.get("graph_us", row["median_us"]) <= row["target_us"]))
    if row.get("target_tflops") is not None and row.get("tflops") is not None:
        parts.append((f">= {row['target_tflops']:.0f} TFLOP/s", row["tflops"] >= row["target_tflops"]))
    if row.get("target_speedup") is not None and row.get("speedup_vs_dense") is not None:
        parts.append((f">= {row['target_speedup']:g}x vs dense (got {row['speedup_vs_dense']:.1f}x)",
                      row["speedup_vs_dense"] >= row["target_speedup"]))
    if row.get("target_speedup_with_projections") is not None:
        want, got = row["target_speedup_with_projections"], row["speedup_with_projections"]
        parts.append((f">= {want:g}x vs dense with projections (got {got:.1f}x)", got >= want))
    if row.get("target_faster_than_dense"):
        got, proj = row["speedup_vs_dense"], row["speedup_with_projections"]
        parts.append((f"faster than dense, with projections too (got {got:.2f}x, {proj:.2f}x)", got > 1 and proj > 1))
    if row.get("target_tokens_per_s") is not None:
        parts.append((f">= {row['target_tokens_per_s']:g} tokens/s (got {row['tokens_per_s']:.0f})",
                      row["tokens_per_s"] >= row["target_tokens_per_s"]))
    if row.get("target_host_share") is not None:
        parts.append((f"host share <= {100 * row['target_host_share']:g}% (got {100 * row['host_share']:.1f}%)",
                      row["host_share"] <= row["target_host_share"]))
    if row.get("target_ratio_to_first") is not None:
        parts.append((f"<= {100 * row['target_ratio_to_first']:g}% of the first (got {100 * row['ratio_to_first']:.2f}%)",
                      row["ratio_to_first"] <= row["target_ratio_to_first"]))
    if not parts:
        return "", None
    return "; ".join(t for t, _ in parts), all(m for _, m in parts)


def _cells(row: dict) -> list[str]:
    frac = row.get("frac_ceiling")
    text, met = target(row)
    return [row["name"], row["impl"], _shape(row.get("shape", {})), _num(row["median_us"], ".1f"),
            _num(row.get("graph_us"), ".1f"), _num(row.get("tbps"), ".2f"), _num(row.get("tflops"), ".0f"),
            "" if frac is None else f"{100 * frac:.0f}% {row.get('bound', '')}",
            text + ("" if met is None else " (met)" if met else " (missed)")]


HEAD = ["op", "impl", "shape", "median us", "graph us", "TB/s", "TFLOP/s", "of same-run ceiling", "target"]


def format_rows(rows: list) -> str:
    """A fixed-width text table of result rows (the CLI's closing print)."""
    table = [HEAD] + [_cells(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table)


def load_results(folder: str) -> list[dict]:
    """Every result file in ``folder``, newest first within each op."""
    docs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        if "op" in doc and "rows" in doc and "ceilings" in doc:
            doc["path"] = os.path.basename(path)
            docs.append(doc)
    return sorted(docs, key=lambda d: (d["op"], d["env"].get("time_utc", d["env"].get("date", ""))), reverse=True)


def render_markdown(docs: list[dict]) -> str:
    """README tables: the ceilings of each run, then the rows with a target of the newest run of each op."""
    if not docs:
        return "_No benchmark results committed yet._"
    lines = ["| result file | GPU | copy TB/s | bf16 TFLOP/s | fp8 TFLOP/s | torch | triton | git |",
             "|---|---|---|---|---|---|---|---|"]
    newest, seen = [], set()
    for d in docs:
        if d["op"] in seen:
            continue
        seen.add(d["op"])
        newest.append(d)
        c, e = d["ceilings"], d["env"]
        lines.append(f"| `{d['path']}` | {e.get('gpu', e.get('cpu', '?'))} | {_num(c.get('copy_tbps'), '.2f')} | "
                     f"{_num(c.get('bf16_tflops'), '.0f')} | {_num(c.get('fp8_tflops'), '.0f')} | "
                     f"{e.get('torch', '')} | {e.get('triton', '')} | `{e.get('git_sha', '')[:10]}` |")
    rows = [r for d in sorted(newest, key=lambda d: d["op"]) for r in d["rows"] if target(r)[1] is not None]
    if rows:
        lines += ["", "Rows with a target (every other row is in the JSON):", "",
                  "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def update_readme(readme: str, markdown: str) -> None:
    """Replace what stands between the perf markers of ``readme`` with ``markdown``."""
    with open(readme) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise DSAError(f"{readme}: no {BEGIN} ... {END} markers to render between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n{markdown}\n{END}{tail}")



def _key(row: dict) -> tuple:
    return row["name"], row["impl"], json.dumps(row.get("shape", {}), sort_keys=True)


def _pair_cells(one: dict | None, many: dict, n: int) -> list[str]:
    """A row of the TP comparison: times (us), speedup, the all-reduce's share of TP=N and the
    replicated share of TP=1 it implies (assuming the sharded part runs in 1/N of its TP=1 time)."""
    decode = many["name"] == "engine_decode"
    t1 = None if one is None else one["median_us"]
    r1 = None if one is None else one.get("replay_us") if decode else one["median_us"]
    rn = many.get("replay_us") if decode else many["median_us"]
    bare = many.get("replay_no_allreduce_us") if decode else many.get("no_allreduce_us")
    share = None if bare is None or not rn else 1 - bare / rn
    replicated = None if None in (r1, bare) or n < 2 else (n * bare - r1) / (n - 1) / r1
    return [many["name"], many["impl"], _shape(many.get("shape", {})), _num(t1, ".0f"), _num(many["median_us"], ".0f"),
            _num(None if t1 is None else t1 / many["median_us"], ".2f"), _num(r1 if decode else None, ".0f"),
            _num(rn if decode else None, ".0f"), _num(bare, ".0f"), _num(None if share is None else 100 * share, ".1f"),
            _num(None if replicated is None else 100 * replicated, ".0f")]


TP_HEAD = ["op", "impl", "shape", "TP=1 us", "TP=N us", "speedup", "TP=1 replay us", "TP=N replay us",
           "TP=N without all-reduce us", "all-reduce % of TP=N", "replicated % of TP=1 (est.)"]


def tp_compare(docs: list[dict]) -> str:
    """Markdown: the newest ``engine`` result (TP=1) beside the newest ``engine-tpN`` result of each N.
    Decode rows compare step wall times and graph replays, prefill rows wall times; the replicated
    share is an estimate, ``(N * without_all_reduce - TP=1) / (N - 1)`` over TP=1, from the model
    ``T = replicated + sharded / N`` (no measurement of the replicated parts alone)."""
    one = next((d for d in docs if d["op"] == "engine"), None)
    base = {} if one is None else {_key(r): r for r in one["rows"]}
    out, seen = [], set()
    for d in docs:
        if not d["op"].startswith("engine-tp") or d["op"] in seen:
            continue
        seen.add(d["op"])
        n = d["rows"][0].get("tp_size") if d["rows"] else None
        path = d["rows"][0].get("allreduce") if d["rows"] else None
        out += [f"TP={n} `{d['path']}` (all-reduce: {path}) against TP=1 "
                + (f"`{one['path']}`" if one else "(no TP=1 engine result)") + ":", "",
                "| " + " | ".join(TP_HEAD).replace("TP=N", f"TP={n}") + " |", "|" + "---|" * len(TP_HEAD)]
        out += ["| " + " | ".join(_pair_cells(base.get(_key(r)), r, n)) + " |" for r in d["rows"]]
        out.append("")
    return "\n".join(out).rstrip()
