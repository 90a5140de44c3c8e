"""Render the committed benchmark JSON that docs/benchmarks.md quotes into its tables.

    python benchmarks/render.py              # print the tables
    python benchmarks/render.py --write      # replace each table in docs/benchmarks.md between its markers
    python benchmarks/render.py --check      # exit 1 if docs/benchmarks.md differs from a fresh render

Each table is rendered from the result files TABLES names for it (one file per op: never "the newest
file"), between the lines <!-- render:NAME begin --> and <!-- render:NAME end -->; nothing else in
the document is touched.
"""
import argparse
import json
import os
import sys

from dsa.bench.report import render_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(HERE, "..", "docs", "benchmarks.md")

TABLES = {  # table name -> the result files it renders, in its ceilings table's order
    "perf-table": [
        "topk-h200-2026-12-01.json", "prefix-h200-2026-12-01.json", "mla-h200-2026-12-01.json",
        "layer-h200-2026-12-01.json", "indexer-logits-sweep-h200-2026-12-01.json", "indexer-h200-2026-12-01.json",
        "engine-h200-2026-12-01.json", "deepgemm-h200-2026-12-01.json", "crossover-h200-2026-11-29.json",
        "ceilings-h200-2026-11-29.json",
    ],
    "guard-b5ef3ef": ["layer-h200-2026-12-01-guard-at-b5ef3ef.json", "engine-h200-2026-12-01-guard-at-b5ef3ef.json"],
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- render:{name} begin -->", f"<!-- render:{name} end -->"


def render_table(files: list[str], results: str = RESULTS) -> str:
    """The ceilings of each named file, then every row with a target; one file per op, or ValueError."""
    docs = []
    for name in files:
        with open(os.path.join(results, name)) as f:
            doc = json.load(f)
        if any(d["op"] == doc["op"] for d in docs):
            raise ValueError(f"files: two result files of op {doc['op']!r} in one table ({name})")
        docs.append(dict(doc, path=name))
    return render_markdown(docs)


def replace_tables(text: str, tables: dict[str, str]) -> str:
    """``text`` with each table's lines between its markers replaced; a missing marker is a ValueError."""
    for name, markdown in tables.items():
        begin, end = markers(name)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise ValueError(f"text: needs one {begin} line before one {end} line")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{markdown}\n{end}{tail}"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=RESULTS, help="folder of the result files (default: %(default)s)")
    parser.add_argument("--doc", default=DOC, help="the document holding the markers (default: %(default)s)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update --doc in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if --doc differs from a fresh render")
    args = parser.parse_args(argv)
    try:
        tables = {name: render_table(files, args.results) for name, files in TABLES.items()}
        if not (args.write or args.check):
            print("\n\n".join(tables.values()))
            return 0
        with open(args.doc) as f:
            text = f.read()
        new = replace_tables(text, tables)
    except (OSError, ValueError) as e:
        print(f"benchmarks/render.py: {e}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"{args.doc}: its rendered tables differ from {args.results}; run python benchmarks/render.py "
                  "--write", file=sys.stderr)
            return 1
        return 0
    with open(args.doc, "w") as f:
        f.write(new)
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
