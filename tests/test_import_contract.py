"""The architecture is a contract the suite checks: ``lint-imports`` runs the contracts of
pyproject.toml's ``[tool.importlinter]`` (layers in order, private modules kept inside their
package, backend clients inside storage, no import cycles) and fails the test on any broken one.
ARCHITECTURE.md describes each layer. Besides: the product never imports the test kit, and the
examples, which users copy, import only opd_store's public modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=root, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_every_contract_of_the_package_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert {contract["id"] for contract in declared} == {"layers", "private-modules", "backend-clients", "no-cycles"}


@pytest.mark.parametrize("module, source, broken", [
    # upward: the layers contract, and the cycle it closes (tiered imports store)
    ("store/_upward.py", "from ..tiered import TieredStore\n", ["Layers:", "No import cycle"]),
    # store is above commit: the layers contract holds, the private one does not
    ("commit/_peek.py", "import opd_store.format._names\n", ["A _private module"]),
    ("opd/_client.py", "import fsspec\n", ["fsspec, s3fs"]),
    ("format/_sibling.py", "from . import _names\n", []),  # inside its own package: every contract kept
])
def test_the_contracts_see_a_violation(tmp_path, module, source, broken):
    """A copy of the package with one offending module breaks exactly the contract about it."""
    shutil.copytree(ROOT / "opd_store", tmp_path / "opd_store", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "opd_store" / module).write_text(source)
    result = lint_imports(tmp_path)
    assert result.returncode == (1 if broken else 0), result.stdout + result.stderr
    assert f"Contracts: {4 - len(broken)} kept, {len(broken)} broken." in result.stdout
    if broken:
        report = " ".join(result.stdout.split("Broken contracts", 1)[1].split())  # lines are wrapped
        assert all(name in report for name in broken)
        assert module.rpartition("/")[2].removesuffix(".py") in report


def imported_modules(path: Path) -> list[str]:
    """Every module an ``import`` or ``from ... import`` statement of ``path`` names (absolute ones)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_product_never_imports_the_test_kit_and_examples_use_the_public_api():
    product = sorted((ROOT / "opd_store").rglob("*.py"))
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert len(product) > 50 and examples
    offending = [f"{path.relative_to(ROOT)}: {name}" for path in product for name in imported_modules(path)
                 if name.split(".")[0] == "opd_testkit"]
    offending += [f"{path.relative_to(ROOT)}: {name}" for path in examples for name in imported_modules(path)
                  if name.split(".")[0] == "opd_testkit"
                  or (name.split(".")[0] == "opd_store" and any(part.startswith("_") for part in name.split(".")))]
    assert offending == []
