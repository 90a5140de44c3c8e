"""``python -m dsa <command>`` (also the ``dsa`` script): demo, bench, recall."""
import argparse
import sys

NOT_BUILT = {"recall": 7}


def main(argv=None) -> int:
    from dsa import bench, demo

    parser = argparse.ArgumentParser(prog="dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, issue in NOT_BUILT.items():
        p = sub.add_parser(name, help=f"(not built yet: issue #{issue})")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, name=name, issue=issue: _not_built(name, issue))
    demo.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def _not_built(name: str, issue: int) -> int:
    print(f"dsa {name}: not built yet (arrives with issue #{issue})", file=sys.stderr)
    return 2
