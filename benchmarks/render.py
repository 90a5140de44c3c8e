"""Render the committed benchmark JSON into README.md's performance tables.

    python benchmarks/render.py              # print the tables
    python benchmarks/render.py --write      # replace them in README.md between the perf markers
"""
import argparse
import os

from dsa.bench.report import render_command

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args()
    raise SystemExit(render_command(args.results, os.path.join(HERE, "..", "README.md") if args.write else None))
