"""The import layering of ``opd_store``: dependencies point one way, storage at the bottom, CLI on top.

Every module of the package is placed in exactly one layer (ARCHITECTURE.md describes each); an
import from a lower layer to a higher one, a module no layer claims, or an import cycle between
modules fails the test. Imports inside functions and ``TYPE_CHECKING`` blocks count for the
direction (they are dependencies all the same); cycles are checked on imports that run.

Run it as a script to print every module's layer and imports::

    python tests/test_layering.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "opd_store"

# Bottom to top. A pattern is a module name, or a package name ending in ".*" (every module in it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("pure", ("opd_store._version", "opd_store.errors", "opd_store.checksum", "opd_store.layout",
              "opd_store.manifest", "opd_store.torch_io", "opd_store.thread_random", "opd_store.exit_hooks",
              "opd_store.preemption", "opd_store.kill_points")),
    ("storage", ("opd_store.storage", "opd_store.storage.*")),
    ("store", ("opd_store.status", "opd_store.verified_reads", "opd_store.store_api", "opd_store.store", "opd_store.attempt",
               "opd_store.store_refs", "opd_store.payload_writer", "opd_store.transaction",
               "opd_store.part_transaction", "opd_store.transfer", "opd_store.pins", "opd_store.resume_guard")),
    ("retention", ("opd_store.retention", "opd_store.pruning", "opd_store.orphans")),
    ("pipeline", ("opd_store.pipeline", "opd_store.pipeline.*")),
    ("tiered", ("opd_store.tier_routing", "opd_store.tier_uploads", "opd_store.tiered")),
    ("dcp", ("opd_store.dcp", "opd_store.dcp.*")),
    ("opd", ("opd_store.opd", "opd_store.opd.*")),
    ("integrations", ("opd_store.integrations", "opd_store.integrations.*")),
    ("job", ("opd_store.job", "opd_store.job.*")),
    ("cli", ("opd_store.cli", "opd_store.cli.*", "opd_store.__main__")),
    ("api", ("opd_store",)),
    ("testing", ("opd_store.testing", "opd_store.testing.*")),
]

# The only imports of the product into the testing package (the top layer), each with its reason.
# Any other import of ``opd_store.testing`` from the product fails the layering test.
AGREED_UPWARD: dict[tuple[str, str], str] = {
    ("opd_store.job.demo", "opd_store.testing.machines"):
        "the kill-and-resume demo starts every process on a fresh machine, as the spot tests and the soak do",
    ("opd_store.cli.demo_cmd", "opd_store.testing.s3"):
        "`opd-store demo --s3-emulator` runs the demo against the tests' moto server (imported when asked for)",
}


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the layer claiming ``module`` (the most specific pattern), or None."""
    best: tuple[int, int] | None = None  # (specificity, layer)
    for index, (_name, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                if module.startswith(prefix + "."):
                    score = len(prefix)
                else:
                    continue
            elif module == pattern:
                score = len(pattern) + 1000
            else:
                continue
            if best is None or score > best[0]:
                best = (score, index)
    return None if best is None else best[1]


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, module: str, known: set[str]) -> dict[str, bool]:
    """``{imported opd_store module: runs at import time or call time (not TYPE_CHECKING only)}``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, bool] = {}

    def add(name: str, node: ast.AST) -> None:
        while name and name not in known:  # "opd_store.errors.X" -> the module "opd_store.errors"
            name = name.rpartition(".")[0]
        if name and name != module:
            runtime = not _under_type_checking(node, parents)
            found[name] = found.get(name, False) or runtime

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("opd_store"):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                add(candidate if candidate in known else target, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("opd_store"):
                    add(alias.name, node)
    return found


def graph(root: Path = PACKAGE_ROOT) -> dict[str, dict[str, bool]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(paths)
    return {module: imports_of(path, module, known) for module, path in paths.items()}


def upward_imports(deps: dict[str, dict[str, bool]]) -> list[str]:
    problems = []
    for module, imported in sorted(deps.items()):
        own = layer_of(module)
        for target in sorted(imported):
            other = layer_of(target)
            if own is not None and other is not None and other > own and (module, target) not in AGREED_UPWARD:
                problems.append(f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[other][0]})")
    return problems


def cycles(deps: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Strongly connected components of more than one module, over imports that run."""
    runtime = {m: sorted(t for t, runs in imported.items() if runs) for m, imported in deps.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in runtime.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(runtime):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(module for module in graph() if layer_of(module) is None)
    assert unplaced == [], f"modules no layer claims (add them to LAYERS and ARCHITECTURE.md): {unplaced}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert upward_imports(graph()) == []


def test_every_agreed_upward_import_is_still_used():
    deps = graph()
    assert [pair for pair in AGREED_UPWARD if pair[1] not in deps.get(pair[0], {})] == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_checker_sees_an_upward_import():
    deps = {"opd_store.store": {"opd_store.tiered": True}, "opd_store.tiered": {"opd_store.store": True}}
    assert upward_imports(deps) == ["opd_store.store (store) imports opd_store.tiered (tiered)"]
    assert cycles(deps) == [["opd_store.store", "opd_store.tiered"]]
    product_into_testing = {"opd_store.job.train": {"opd_store.testing.s3": True},
                            "opd_store.job.demo": {"opd_store.testing.machines": True}}
    assert upward_imports(product_into_testing) == [
        "opd_store.job.train (job) imports opd_store.testing.s3 (testing)"]  # the demo's is agreed


def main() -> int:
    deps = graph()
    for module in sorted(deps, key=lambda m: (layer_of(m) if layer_of(m) is not None else -1, m)):
        layer = layer_of(module)
        name = LAYERS[layer][0] if layer is not None else "UNPLACED"
        print(f"{name:10} {module} -> {', '.join(sorted(deps[module])) or '-'}")
    problems = upward_imports(deps)
    print(f"\nupward imports: {len(problems)}")
    for line in problems:
        print(f"  {line}")
    loops = cycles(deps)
    print(f"import cycles: {len(loops)}")
    for loop in loops:
        print(f"  {' <-> '.join(loop)}")
    return 1 if problems or loops else 0


if __name__ == "__main__":
    sys.exit(main())
