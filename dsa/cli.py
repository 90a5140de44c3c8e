"""``python -m dsa <command>`` (also the ``dsa`` script): demo, bench, recall."""
import argparse


def main(argv=None) -> int:
    from dsa import bench, demo, recall

    parser = argparse.ArgumentParser(prog="dsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    recall.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)

