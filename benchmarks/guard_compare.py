"""Compare a speed guard's runs (benchmarks/guard.sh): base against new, alternated rounds.

    python benchmarks/guard_compare.py RUNS [--tolerance 0.03] [--json guard.json]

``RUNS/{base,new}/r{N}/{layer,engine}-*.json`` are ``dsa bench layer|engine`` results. Each row (name,
implementation, shape) and metric takes the median over the rounds per side; the ratio is new / base.
Gated (exit status 1 when a ratio exceeds 1 + tolerance): the graph-replay times, that is the layer rows
replayed from a CUDA graph (``impl`` ending in ``+graph``: ``median_us``, L2 flushed outside the graph)
and the engine's decode replay (``replay_us``). Reported, not gated: eager layer rows, the engine's
wall time per step and its prefill (the host share moves with what else the host does).
"""
import argparse
import glob
import json
import os
import statistics
import sys


def rows_of(folder: str) -> dict:
    """``{(name, impl, shape): row}`` of every result file in ``folder``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            for row in json.load(f)["rows"]:
                out[(row["name"], row["impl"], json.dumps(row["shape"], sort_keys=True))] = row
    return out


def metrics(row: dict) -> dict:
    """``{metric: gated?}`` of one row."""
    if row["name"].startswith("layer_"):
        return {"median_us": row["impl"].endswith("+graph")}
    if "replay_us" in row:
        return {"replay_us": True, "median_us": False}
    return {"median_us": False}


def compare(runs: str, tolerance: float) -> dict:
    sides = {side: [rows_of(r) for r in sorted(glob.glob(os.path.join(runs, side, "r*")))] for side in ("base", "new")}
    if not sides["base"] or len(sides["base"]) != len(sides["new"]):
        raise SystemExit(f"{runs}: expected as many base as new rounds (r1, r2, ...), found "
                         f"{len(sides['base'])} and {len(sides['new'])}")
    keys = sorted(set.intersection(*(set(r) for side in sides.values() for r in side)))
    missing = sorted(set.union(*(set(r) for side in sides.values() for r in side)) - set(keys))
    table = []
    for key in keys:
        for metric, gated in metrics(sides["base"][0][key]).items():
            base = [r[key][metric] for r in sides["base"]]
            new = [r[key][metric] for r in sides["new"]]
            ratio = statistics.median(new) / statistics.median(base)
            table.append({"name": key[0], "impl": key[1], "shape": json.loads(key[2]), "metric": metric,
                          "gated": gated, "base_us": base, "new_us": new, "ratio": ratio,
                          "passed": ratio <= 1 + tolerance if gated else None})
    return {"tolerance": tolerance, "rounds": len(sides["base"]), "rows": table, "rows_in_only_some_runs": missing,
            "passed": all(r["passed"] for r in table if r["gated"]),
            "env": {side: json.load(open(sorted(glob.glob(os.path.join(runs, side, "r1", "*.json")))[0]))["env"]
                    for side in sides}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", help="guard.sh's run folder (base/rN/*.json, new/rN/*.json)")
    p.add_argument("--tolerance", type=float, default=0.03, help="gated rows: new / base <= 1 + this")
    p.add_argument("--json", help="write the comparison (and every run's numbers) here")
    args = p.parse_args(argv)
    result = compare(args.runs, args.tolerance)
    print(f"{'row':<24} {'impl':<13} {'shape':<34} {'metric':<10} {'base us':>10} {'new us':>10} {'new/base':>9}")
    for r in result["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        verdict = "" if not r["gated"] else ("ok" if r["passed"] else f"SLOWER than +{args.tolerance:.0%}")
        print(f"{r['name']:<24} {r['impl']:<13} {shape:<34} {r['metric']:<10} {statistics.median(r['base_us']):>10.1f} "
              f"{statistics.median(r['new_us']):>10.1f} {r['ratio']:>9.3f} {verdict}")
    if result["rows_in_only_some_runs"]:
        print(f"rows missing from some runs (not compared): {result['rows_in_only_some_runs']}")
    print(f"guard {'passed' if result['passed'] else 'FAILED'}: {sum(r['gated'] for r in result['rows'])} graph-replay "
          f"rows gated at +{args.tolerance:.0%}, medians of {result['rounds']} alternated rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
