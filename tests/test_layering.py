"""The dependency direction, read from the source: kernels import nothing of dsa; cache only kernels;
the indexer only cache, kernels and the config leaf; the config leaf only kernels."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = {  # folder -> the dsa packages its modules may import (besides their own folder)
    "kernels": set(),
    "cache": {"dsa.kernels"},
    "indexer": {"dsa.kernels", "dsa.cache", "dsa.config"},
}


def _dsa_imports(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("dsa"):
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            names.add("dsa")  # `from .. import x`: reaching above the package
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("dsa"))
    return names


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_packages_import_only_what_is_below_them(folder):
    for path in sorted((ROOT / folder).glob("*.py")):
        bad = {m for m in _dsa_imports(path)
               if not any(m == a or m.startswith(a + ".") for a in ALLOWED[folder] | {f"dsa.{folder}"})}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_config_leaf_imports_only_kernels():
    bad = {m for m in _dsa_imports(ROOT / "dsa" / "config.py") if not m.startswith("dsa.kernels")}
    assert not bad, f"dsa/config.py imports {sorted(bad)}"
