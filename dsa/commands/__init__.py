"""The command modules of ``python -m dsa``: one per subcommand, each with ``add_parser`` and
``run(args)``; only :mod:`dsa.cli` imports them."""
