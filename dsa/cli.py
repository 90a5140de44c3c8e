"""The ``dsa`` command (also ``python -m dsa``); its help text is plain (no reST markup).

Building the parser imports no torch (each command imports what it runs inside its ``run``), so that
``--help`` answers at once."""
import argparse
import sys

from dsa import __version__
from dsa.commands import bench, demo, dispatch, fit_indexer, generate, needle, recall, serve

DESCRIPTION = "DeepSeek Sparse Attention inference: dsa <command> (or python -m dsa <command>)."
COMMANDS = (demo, generate, serve, recall, needle, bench, fit_indexer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dsa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for result files
    return dispatch(args)
