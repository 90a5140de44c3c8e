"""No function in ``dsa/`` is longer than MAX_LINES (issue #35): a longer one is split into plain
functions, each doing one job. A function's length is its ``def`` line to its last line
(``end_lineno - lineno + 1``: decorators not counted, its docstring and nested functions counted);
each nested function and method is measured too, under its qualified name (``HostPlan.pack``).
"""
import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 80


def function_lengths(source: str) -> dict:
    """``{qualified name: lines}`` of every function and method in ``source``, nested ones included."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def too_long() -> dict:
    """``{(file, function): lines}`` of the functions in ``dsa/`` over MAX_LINES."""
    found = {}
    for path in sorted((ROOT / "dsa").rglob("*.py")):
        for name, lines in function_lengths(path.read_text()).items():
            if lines > MAX_LINES:
                found[(path.relative_to(ROOT).as_posix(), name)] = lines
    return found


def _function(lines: int, decorators: int = 0, indent: str = "") -> str:
    """A function of exactly ``lines`` lines (after ``decorators`` decorator lines)."""
    body = ["@staticmethod"] * decorators + ["def f():"] + ["    x = 1"] * (lines - 2) + ["    return x"]
    return textwrap.indent("\n".join(body), indent) + "\n"


@pytest.mark.parametrize("source,want", [
    (_function(2), {"f": 2}),
    (_function(81), {"f": 81}),
    (_function(80, decorators=3), {"f": 80}),
    ("class C:\n" + _function(5, decorators=1, indent="    "), {"C.f": 5}),
    ("async def g():\n" + _function(3, indent="    ") + "    return f\n", {"g": 5, "g.f": 3}),
    ("if True:\n    class D:\n        class E:\n" + _function(4, indent="            "), {"D.E.f": 4}),
    ("x = 1\n", {}),
], ids=["two-lines", "81-lines", "decorators-not-counted", "method", "nested-in-async", "class-in-if-in-class",
        "no-function"])
def test_function_lengths_measures_every_function(source, want):
    got = function_lengths(source)
    assert got == want, f"measured {got}, expected {want} in:\n{source}"


def test_no_function_is_longer_than_the_limit():
    over = too_long()
    assert not over, (f"functions over {MAX_LINES} lines (split each into plain functions doing one job): "
                      + ", ".join(f"{f}:{name}:{lines}" for (f, name), lines in sorted(over.items())))
