"""The summary and table of a ``dsa needle`` results file, partial or complete, without the teacher:

    python benchmarks/quality/needle_report.py RESULTS.jsonl [--json OUT.json]

(``dsa needle`` writes needle.json itself at the end of every run; this reads a results file that came
back from another machine.) The JSON holds the file's header, its runs and the summary by task and length,
depth and needle kind, with the paired counts against dense (:func:`dsa.quality.needle.group`).
"""
import argparse
import json

from dsa.quality import needle_file
from dsa.quality.needle import summarize, table_text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a needle.jsonl")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()
    header, samples, runs = needle_file.read(args.results)
    grid = header["grid"]
    records = [{k: v for k, v in r.items() if k != "seconds"} for r in samples]
    total = len(grid["tasks"]) * len(grid["lengths"]) * grid["samples"]
    result = {"source": args.results, "header": header, "runs": runs, "samples_done": len(records),
              "samples_total": total, "complete": len(records) == total,
              "seconds_by_rule": {r: round(sum(x["seconds"][r] for x in samples), 1) for r in grid["rules"]},
              "args": grid, "summary": summarize(records)}
    result["records"] = records
    print(table_text(result))
    print(f"{len(records)} of {total} samples, {round(sum(r['seconds'] for r in runs), 1)} s in {len(runs)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "records"}, f, indent=1)


if __name__ == "__main__":
    main()
