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


PUBLIC = ["Completion", "DSAAttention", "DSAConfig", "DSAModel", "Delta", "Engine", "EngineStats", "LLM", "BatchPlan",
          "LightningIndexer", "SamplingParams", "absorb_kv_b", "bytes_per_token", "layer_runs_indexer", "softmax_scale"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_import_from_dsa(name):
    import dsa
    assert name in dsa.__all__ and getattr(dsa, name) is not None
