"""Count the suite's test functions and ``assert`` statements (a check that no assertion was lost).

    .venv/bin/python scripts/count_asserts.py [ROOT ...]     # default: tests testkit/opd_testkit opd_store/testing

Prints one line per root and a total: files, test functions (``def test_*`` at module or class
level), ``assert`` statements (every ``ast.Assert`` node, in tests and in the helpers they call) and
``pytest.raises`` blocks (each asserts that an exception is raised). ``opd_store/testing`` holds the
storage conformance suite, whose checks every backend's test class runs. The number of collected tests
(parametrised cases included) comes from ``pytest --collect-only -q``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def count(path: Path) -> tuple[int, int, int]:
    """``(test functions, assert statements, pytest.raises calls)`` of one Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    tests = asserts = raises = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            tests += 1
        elif isinstance(node, ast.Assert):
            asserts += 1
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "raises"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"):
            raises += 1
    return tests, asserts, raises


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("tests"), Path("testkit/opd_testkit"), Path("opd_store/testing")]
    totals = [0, 0, 0, 0]
    for root in roots:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root] if root.exists() else []
        sums = [0, 0, 0]
        for file in files:
            for i, value in enumerate(count(file)):
                sums[i] += value
        print(f"{root}: {len(files)} files, {sums[0]} test functions, {sums[1]} assert statements, "
              f"{sums[2]} pytest.raises")
        totals = [totals[0] + len(files)] + [t + s for t, s in zip(totals[1:], sums)]
    print(f"total: {totals[0]} files, {totals[1]} test functions, {totals[2]} assert statements, "
          f"{totals[3]} pytest.raises")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
