"""The project's error for a run that cannot go on, with a message that says why in one line.

The library raises :class:`DSAError` where a person has to act: no CUDA device, an optional
extra not installed, an input file that lacks what the run needs, a server that did not start, a
kernel that disagrees with its reference (a bench refuses to time it). ``dsa.commands`` turns it
into the command's exit, the message alone on stderr and exit status 1, no traceback; Python
callers catch it like any exception. Bad arguments to a function stay ValueError/TypeError.
"""


class DSAError(Exception):
    """A one-line reason the run stops (see the module docstring)."""
