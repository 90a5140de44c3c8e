"""The command modules of ``python -m dsa``: one per subcommand, each with ``add_parser`` and
``run(args)``; only :mod:`dsa.cli` imports them, and runs the parsed one through :func:`dispatch`."""
from dsa.errors import DSAError


def dispatch(args) -> int:
    """``args.func(args)``; a :class:`~dsa.errors.DSAError` from the library exits with its message
    (one line, exit status 1, no traceback), as the commands' own refusals do."""
    try:
        return args.func(args)
    except DSAError as e:
        raise SystemExit(str(e)) from None
