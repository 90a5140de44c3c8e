"""The dependency direction, read from the source (every import, at module level or in a function):

    kernels <- cache <- indexer <- model <- engine <- serve

with ``dsa.config`` a leaf anyone may import (it imports only kernels). ``quality`` may import the
model, the engine and the benches, never ``serve``; ``serve`` never imports ``quality`` or
``bench``; the command modules (``dsa.commands``) are imported by ``dsa.cli`` alone.

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
ALLOWED = {  # layer -> the layers its modules may import (besides its own)
    **BELOW,
    "config": ["kernels"],
    "testing": BELOW["serve"],
    "bench": BELOW["serve"] + ["serve", "testing"],
    "quality": BELOW["engine"] + ["engine", "bench", "testing"],
    "commands": BELOW["serve"] + ["serve", "quality", "bench"],
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
        bad = {m for m in _dsa_imports(path) if _package(m) not in set(ALLOWED[layer]) | {layer, "__version__"}}
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


PUBLIC = ["Completion", "DSAAttention", "DSAConfig", "DSAModel", "Delta", "Engine", "EngineStats", "LLM", "BatchPlan",
          "LightningIndexer", "SamplingParams", "absorb_kv_b", "bytes_per_token", "layer_runs_indexer", "softmax_scale"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_import_from_dsa(name):
    import dsa
    assert name in dsa.__all__ and getattr(dsa, name) is not None
