"""``python -m dsa <command>`` (also the ``dsa`` script): demo, generate, serve, bench, recall, fit-indexer."""
import argparse


def main(argv=None) -> int:
    from dsa import __version__, bench, demo, fit, generate, recall, serve

    parser = argparse.ArgumentParser(prog="dsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dsa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    generate.add_parser(sub)
    serve.add_parser(sub)
    recall.add_parser(sub)
    bench.add_parser(sub)
    fit.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)
