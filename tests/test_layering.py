"""The dependency direction, read from the source (every import, at module level or in a function):

    kernels <- cache <- indexer <- model <- engine <- serve

with ``dsa.config`` a leaf anyone may import (it imports only kernels) and ``dsa.errors`` a leaf anyone
may import (it imports nothing). ``dsa.report`` (run records and figures) serves the benches, the
quality tools and the commands. ``quality`` may import the model and the engine, never ``bench`` or
``serve``; ``serve`` never imports ``quality`` or ``bench``; the command modules (``dsa.commands``)
are imported by ``dsa.cli`` alone. No dsa module imports itself through others (no import cycle),
and only ``dsa.commands`` (and ``dsa/__main__.py``) raise ``SystemExit`` or build argument parsers
(``dsa.cli`` builds the top one): the library raises typed errors, :class:`dsa.errors.DSAError`
for a one-line stop, which the commands turn into the exit.

The packages and their folders are pyproject.toml's (``[tool.setuptools]`` ``packages`` and
``package-dir``: ``dsa.kernels`` is ``kernels/``), the one map both setuptools and these tests read.
"""
import ast
import pathlib
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs tomli there
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str) -> pathlib.Path:
    """A package's folder as setuptools finds it: its longest prefix in package-dir, then the rest of its name."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in SETUPTOOLS["package-dir"]:
            return ROOT.joinpath(SETUPTOOLS["package-dir"][".".join(parts[:i])], *parts[i:])
    return ROOT.joinpath(*parts)


PACKAGES = {p: _folder(p) for p in SETUPTOOLS["packages"]}  # "dsa.kernels" -> ROOT / "kernels"
SOURCES = {}  # layer -> its source files: each subpackage of dsa (with its own subpackages), and each module of dsa
for _package_name, _folder_path in sorted(PACKAGES.items()):
    if _package_name != "dsa":
        SOURCES.setdefault(_package_name.split(".")[1], []).extend(sorted(_folder_path.glob("*.py")))
SOURCES.update({f.stem: [f] for f in PACKAGES["dsa"].glob("*.py") if f.name not in ("__init__.py", "__main__.py")})
BELOW = {"kernels": [], "cache": ["kernels"], "indexer": ["kernels", "cache", "config"]}
BELOW["model"] = BELOW["indexer"] + ["indexer"]
BELOW["engine"] = BELOW["model"] + ["model"]
BELOW["serve"] = BELOW["engine"] + ["engine"]
ANYONE = {"errors"}  # leaves every layer may import
ALLOWED = {  # layer -> the layers its modules may import (besides its own and ANYONE)
    **BELOW,
    "errors": [],
    "config": ["kernels"],
    "report": [],
    "testing": BELOW["serve"],
    "bench": BELOW["serve"] + ["serve", "testing", "report"],
    "quality": BELOW["engine"] + ["engine", "testing", "report"],
    "commands": BELOW["serve"] + ["serve", "quality", "bench", "report"],
    "cli": ["commands"],
}


def test_the_package_map_lists_every_package_folder():
    """Every folder with an __init__.py at the top of the checkout or inside a package is a package
    of pyproject.toml, and every package there is such a folder."""
    found = {p.parent for p in ROOT.glob("*/__init__.py")}
    found |= {p.parent for folder in PACKAGES.values() for p in folder.rglob("__init__.py")}
    listed = set(PACKAGES.values())
    assert found == listed, (f"folders with __init__.py missing from pyproject.toml: "
                             f"{sorted(str(f.relative_to(ROOT)) for f in found - listed)}; packages of pyproject.toml "
                             f"that are no such folder: {sorted(p for p, f in PACKAGES.items() if f not in found)}")


def test_the_layering_table_covers_exactly_the_packages():
    assert set(ALLOWED) == set(SOURCES), (f"layers without sources: {sorted(set(ALLOWED) - set(SOURCES))}; "
                                          f"sources without a layer: {sorted(set(SOURCES) - set(ALLOWED))}")
    unknown = {layer: set(below) - set(SOURCES) for layer, below in ALLOWED.items() if set(below) - set(SOURCES)}
    assert not unknown, f"layers allowed to import layers that do not exist: {unknown}"


def _dsa_imports(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "dsa":
            names.update(f"dsa.{a.name}" for a in node.names)  # `from dsa import x`: a package or a top-level name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("dsa"):
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            names.add("dsa")  # `from .. import x`: reaching above the package
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("dsa"))
    return names


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dsa"


@pytest.mark.parametrize("layer", sorted(SOURCES))
def test_packages_import_only_what_is_below_them(layer):
    assert SOURCES[layer], f"no sources for {layer}"
    for path in SOURCES[layer]:
        allowed = set(ALLOWED[layer]) | {layer, "__version__"} | ANYONE
        bad = {m for m in _dsa_imports(path) if _package(m) not in allowed}
        assert not bad, f"{path.relative_to(ROOT)} ({layer}) imports {sorted(bad)}; allowed: {ALLOWED[layer]}"


def test_every_module_is_in_a_package():
    covered = {p for paths in SOURCES.values() for p in paths}
    loose = [p.relative_to(ROOT) for folder in PACKAGES.values() for p in folder.rglob("*.py")
             if p not in covered and p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules outside the layering table: {loose}"


def test_loading_imports_no_other_model_module():
    """Checkpoint loading stays below the model (no import loop between them)."""
    bad = {m for m in _dsa_imports(ROOT / "dsa" / "model" / "loading.py") if m.startswith("dsa.model")}
    assert not bad, f"dsa/model/loading.py imports {sorted(bad)}"


def _module_names() -> dict:
    """``{module name: its file}`` for every module of every package (``dsa.kernels.common`` ->
    kernels/common.py, a package's ``__init__.py`` under the package's own name)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            found[package if path.name == "__init__.py" else f"{package}.{path.stem}"] = path
    return found


MODULES = _module_names()


def import_graph(modules: dict) -> dict:
    """``{module: the dsa modules it imports}``, module level and function level alike: ``from P import n``
    is an edge to the module ``P.n`` where there is one, else to ``P``; relative imports are resolved."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "dsa":
                    continue
                edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict) -> list:
    """The import cycles of ``graph``, each as the path that closes it (``[a, b, a]``)."""
    state, found = {}, []

    def visit(m, path):
        if state.get(m) == "open":
            found.append(path[path.index(m):] + [m])
        if state.get(m) is not None:
            return
        state[m] = "open"
        for dep in sorted(graph.get(m, ())):
            visit(dep, path + [m])
        state[m] = "done"

    for module in sorted(graph):
        visit(module, [])
    return found


def test_no_dsa_module_imports_itself_through_others():
    graph = import_graph(MODULES)
    assert sum(map(len, graph.values())) > 100, "the graph lost its edges: the module map or the resolver broke"
    found = cycles(graph)
    assert not found, "import cycles (function-level imports included): " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("graph, want", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": {"a"}}, [["b", "c", "b"]]),
], ids=["chain", "pair", "triangle", "cycle-below-a-chain"])
def test_the_cycle_finder_finds_planted_cycles(graph, want):
    assert [c for c in cycles(graph) if c] == want, f"cycles({graph}) = {cycles(graph)}, want {want}"


def test_the_import_graph_resolves_relative_and_function_level_imports(tmp_path):
    files = {"dsa.pkg": "from . import a\n", "dsa.pkg.a": "def f():\n    from .b import g\n",
             "dsa.pkg.b": "from dsa.pkg import a\nfrom dsa import pkg\n"}
    modules = {}
    for name, text in files.items():
        path = tmp_path / name / ("__init__.py" if name == "dsa.pkg" else "m.py")
        path.parent.mkdir()
        path.write_text(text)
        modules[name] = path
    graph = import_graph(modules)
    assert graph == {"dsa.pkg": {"dsa.pkg.a"}, "dsa.pkg.a": {"dsa.pkg.b"}, "dsa.pkg.b": {"dsa.pkg.a", "dsa.pkg"}}, graph
    assert cycles(graph) == [["dsa.pkg", "dsa.pkg.a", "dsa.pkg.b", "dsa.pkg"], ["dsa.pkg.a", "dsa.pkg.b", "dsa.pkg.a"]]


COMMAND_LINE = {"dsa.cli", "dsa.__main__"}  # besides dsa.commands: the parser's root and `python -m dsa`
PARSING = {"ArgumentParser", "add_argument", "add_argument_group", "add_parser", "add_subparsers", "parse_args"}


def command_line_code(text: str) -> list:
    """``(line, what)`` of each ``SystemExit`` and each piece of argument parsing in ``text``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name) and node.id == "SystemExit":
            found.append((node.lineno, "SystemExit"))
        elif isinstance(node, ast.Attribute) and node.attr in PARSING:
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and "argparse" in (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]):
            found.append((node.lineno, "argparse"))
    return found


def test_only_the_commands_exit_or_parse_arguments():
    """The library raises a typed error (:class:`dsa.errors.DSAError` for a one-line stop); the
    commands decide the exit status and own the flags."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for name, path in sorted(MODULES.items())
           if not name.startswith("dsa.commands") and name not in COMMAND_LINE
           for line, what in command_line_code(path.read_text())
           if not (name == "dsa.cli" or what == "SystemExit" and name == "dsa.__main__")]
    assert not bad, "command-line code outside dsa.commands: " + "; ".join(bad)


@pytest.mark.parametrize("text, want", [
    ("raise SystemExit('x')\n", [(1, "SystemExit")]),
    ("try:\n    f()\nexcept SystemExit:\n    pass\n", [(3, "SystemExit")]),
    ("def f(p):\n    p.add_argument('--x')\n", [(2, "add_argument")]),
    ("import argparse\n", [(1, "argparse")]),
    ("from argparse import Namespace\n", [(1, "argparse")]),
    ("raise DSAError('x')\nexit_code = 1\n", []),
], ids=["raise", "except", "add-argument", "import", "from-import", "typed-error"])
def test_command_line_code_is_found(text, want):
    assert command_line_code(text) == want, f"{text!r}: {command_line_code(text)}, want {want}"


KERNELS = ROOT / "kernels"


def _kernel_module(path: pathlib.Path) -> str:
    """A kernels module's name below ``dsa.kernels``: ``topk.launch``; a package's ``__init__.py`` is the
    package (``topk``; ``kernels/__init__.py`` is ``""``)."""
    parts = path.relative_to(KERNELS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _kernel_imports(path: pathlib.Path) -> dict:
    """``{kernels module: names}`` a kernels module imports from the other kernels modules (anywhere in it),
    the names it reaches through ``from . import m as alias`` (``alias.name``) included; modules named as
    :func:`_kernel_module` names them."""
    package = path.relative_to(KERNELS).parent.parts  # ("topk",) inside kernels/topk/, () in kernels/
    tree = ast.parse(path.read_text())
    found, aliases = {}, {}

    def module(level: int, name: str | None) -> str:
        base = package[:len(package) + 1 - level] if level else ()
        return ".".join(base + (tuple(name.split(".")) if name else ()))

    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0 and not (node.module or "").startswith("dsa.kernels."):
            continue
        if node.level == 0:
            found.setdefault(node.module[len("dsa.kernels."):], set()).update(a.name for a in node.names)
        elif node.module:
            found.setdefault(module(node.level, node.module), set()).update(a.name for a in node.names)
        else:  # from . import m [as alias]
            for a in node.names:
                found.setdefault(module(node.level, a.name), set())
                aliases[a.asname or a.name] = module(node.level, a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found[aliases[node.value.id]].add(node.attr)
    return found


def test_kernel_modules_import_no_loop():
    """The kernels modules import each other without a cycle (function-level imports included)."""
    graph = {_kernel_module(p): set(_kernel_imports(p)) for p in KERNELS.rglob("*.py")}
    state = {}

    def visit(m, path):
        if state.get(m) == "done" or m not in graph:
            return
        assert state.get(m) != "open", f"import loop: {' -> '.join(path + [m])}"
        state[m] = "open"
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        state[m] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_kernel_modules_use_only_public_names_of_each_other():
    """A name one kernels module takes from another is public there (``kernels/topk/`` is a package so
    that the pieces of one op share names without reaching into each other's privates)."""
    private = {f"{_kernel_module(p) or '__init__'} <- {module}": sorted(n for n in names if n.startswith("_"))
               for p in KERNELS.rglob("*.py") for module, names in _kernel_imports(p).items()}
    private = {edge: names for edge, names in private.items() if names}
    assert not private, f"private names imported across kernels modules: {private}"


def test_mla_launchers_share_mla_split_not_each_other():
    """The split heuristic, the partial buffers and the combine kernel live in ``kernels/mla_split.py``:
    the Hopper launcher never imports the portable one, and the modules that route to the Hopper kernel
    (``sparse_mla``, ``dense_mla_decode``) use only its public names."""
    hopper = _kernel_imports(KERNELS / "sparse_mla_hopper.py")
    assert not {"sparse_mla", "dense_mla_decode"} & set(hopper), sorted(hopper)
    assert "mla_split" in hopper
    split = _kernel_imports(KERNELS / "mla_split.py")
    assert not {"sparse_mla", "sparse_mla_hopper", "dense_mla_decode"} & set(split), sorted(split)
    for name in ("sparse_mla.py", "dense_mla_decode.py"):
        used = _kernel_imports(KERNELS / name).get("sparse_mla_hopper", set())
        assert used and not {u for u in used if u.startswith("_")}, \
            f"kernels/{name} uses {sorted(used)} of sparse_mla_hopper"


def test_the_ragged_hopper_launcher_imports_no_kernel_module():
    """The Gluon ragged-logits kernel is handed its grid: it imports neither the portable launcher nor
    any other kernels module but ``common`` (the Hopper platform rule it shares with the MLA kernel),
    and the portable module uses only its public names."""
    imports = _kernel_imports(KERNELS / "indexer_logits_ragged_hopper.py")
    assert set(imports) <= {"common"}, sorted(imports)
    used = _kernel_imports(KERNELS / "indexer_logits_ragged.py").get("indexer_logits_ragged_hopper", set())
    assert used and not {u for u in used if u.startswith("_")}, sorted(used)


PUBLIC = ["Completion", "DSAAttention", "DSAConfig", "DSAModel", "Delta", "Engine", "EngineStats", "LLM", "BatchPlan",
          "LightningIndexer", "SamplingParams", "absorb_kv_b", "bytes_per_token", "layer_runs_indexer", "softmax_scale"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_import_from_dsa(name):
    import dsa
    assert name in dsa.__all__ and getattr(dsa, name) is not None
