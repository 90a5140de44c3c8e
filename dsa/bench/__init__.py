"""Benchmarks on a CUDA GPU: same-run ceilings (:mod:`.harness`), one module per op, reports and
plots; the command is :mod:`dsa.commands.bench`."""
