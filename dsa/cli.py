"""``python -m dsa <command>`` (also the ``dsa`` script): demo, bench, recall, fit-indexer."""
import argparse


def main(argv=None) -> int:
    from dsa import bench, demo, fit, recall

    parser = argparse.ArgumentParser(prog="dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    recall.add_parser(sub)
    bench.add_parser(sub)
    fit.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)

