"""``python -m dsa <command>`` (also the ``dsa`` script): demo, generate, serve, bench, recall, fit-indexer."""
import argparse
import sys

from dsa import __version__
from dsa.commands import bench, demo, fit_indexer, generate, recall, serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dsa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dsa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (demo, generate, serve, recall, bench, fit_indexer):
        command.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for result files
    return args.func(args)
