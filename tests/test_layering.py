"""The dependency direction, read from the source (every import, at module level or in a function):

    kernels <- cache <- indexer <- model <- engine <- serve

with ``dsa.config`` a leaf anyone may import (it imports only kernels). ``quality`` may import the
model, the engine and the benches, never ``serve``; ``serve`` never imports ``quality`` or
``bench``; the command modules (``dsa.commands``) are imported by ``dsa.cli`` alone.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BELOW = {"kernels": [], "cache": ["kernels"], "indexer": ["kernels", "cache", "config"]}
BELOW["model"] = BELOW["indexer"] + ["indexer"]
BELOW["engine"] = BELOW["model"] + ["model"]
BELOW["serve"] = BELOW["engine"] + ["engine"]
ALLOWED = {  # package -> the dsa packages its modules may import (besides its own)
    **BELOW,
    "config": ["kernels"],
    "testing": BELOW["serve"],
    "bench": BELOW["serve"] + ["serve", "testing"],
    "quality": BELOW["engine"] + ["engine", "bench", "testing"],
    "commands": BELOW["serve"] + ["serve", "quality", "bench"],
    "cli": ["commands"],
}
SOURCES = {  # package -> its source files
    "kernels": "kernels/*.py", "cache": "cache/*.py", "indexer": "indexer/*.py", "config": "dsa/config.py",
    "testing": "dsa/testing.py", "cli": "dsa/cli.py",
    **{p: f"dsa/{p}/*.py" for p in ("model", "engine", "serve", "quality", "bench", "commands")},
}


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


@pytest.mark.parametrize("package", sorted(SOURCES))
def test_packages_import_only_what_is_below_them(package):
    paths = sorted(ROOT.glob(SOURCES[package]))
    assert paths, f"no sources for {package}"
    for path in paths:
        bad = {m for m in _dsa_imports(path) if _package(m) not in set(ALLOWED[package]) | {package, "__version__"}}
        assert not bad, f"{path.relative_to(ROOT)} ({package}) imports {sorted(bad)}; allowed: {ALLOWED[package]}"


def test_every_module_is_in_a_package():
    covered = {p for pattern in SOURCES.values() for p in ROOT.glob(pattern)}
    loose = [p.relative_to(ROOT) for p in ROOT.glob("dsa/**/*.py")
             if p not in covered and p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules outside the layering table: {loose}"


def test_loading_imports_no_other_model_module():
    """Checkpoint loading stays below the model (no import loop between them)."""
    bad = {m for m in _dsa_imports(ROOT / "dsa" / "model" / "loading.py") if m.startswith("dsa.model")}
    assert not bad, f"dsa/model/loading.py imports {sorted(bad)}"


def _kernel_imports(path: pathlib.Path) -> dict:
    """``{kernels module: names}`` a kernels module imports from its siblings (anywhere in it), the names
    it reaches through ``from . import m as alias`` (``alias.name``) included."""
    tree = ast.parse(path.read_text())
    found, aliases = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dsa.kernels."):
            found.setdefault(node.module.split(".")[2], set()).update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # from . import m [as alias]
            for a in node.names:
                found.setdefault(a.name, set())
                aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found[aliases[node.value.id]].add(node.attr)
    return found


def test_kernel_modules_import_no_loop():
    """The kernels modules import each other without a cycle (function-level imports included)."""
    graph = {p.stem: set(_kernel_imports(p)) for p in (ROOT / "kernels").glob("*.py")}
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


def test_mla_launchers_share_mla_split_not_each_other():
    """The split heuristic, the partial buffers and the combine kernel live in ``kernels/mla_split.py``:
    the Hopper launcher never imports the portable one, and the modules that route to the Hopper kernel
    (``sparse_mla``, ``dense_mla_decode``) use only its public names."""
    hopper = _kernel_imports(ROOT / "kernels" / "sparse_mla_hopper.py")
    assert not {"sparse_mla", "dense_mla_decode"} & set(hopper), sorted(hopper)
    assert "mla_split" in hopper
    split = _kernel_imports(ROOT / "kernels" / "mla_split.py")
    assert not {"sparse_mla", "sparse_mla_hopper", "dense_mla_decode"} & set(split), sorted(split)
    for name in ("sparse_mla.py", "dense_mla_decode.py"):
        used = _kernel_imports(ROOT / "kernels" / name).get("sparse_mla_hopper", set())
        assert used and not {u for u in used if u.startswith("_")}, \
            f"kernels/{name} uses {sorted(used)} of sparse_mla_hopper"


PUBLIC = ["Completion", "DSAAttention", "DSAConfig", "DSAModel", "Delta", "Engine", "EngineStats", "LLM", "BatchPlan",
          "LightningIndexer", "SamplingParams", "absorb_kv_b", "bytes_per_token", "layer_runs_indexer", "softmax_scale"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_import_from_dsa(name):
    import dsa
    assert name in dsa.__all__ and getattr(dsa, name) is not None
