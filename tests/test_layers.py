"""The hub's layers, read from its import statements: no cycles, and each layer imports only
what sits below it (the policy decides without I/O, the engine and store know no HTTP)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "syncserver"

# what each core module may not import (module names, or prefixes of third-party packages)
FORBIDDEN = {
    "policy": {"syncserver.*", "fastapi", "starlette", "numpy", "sqlite3", "os", "time"},
    "aggregate": {"syncserver.*", "fastapi", "starlette"},
    "engine": {"fastapi", "starlette", "syncserver.coordinator", "syncserver.routes", "syncserver.policy"},
    "store": {"fastapi", "starlette", "syncserver.coordinator", "syncserver.engine", "syncserver.policy"},
    "uploads": {"fastapi", "starlette", "syncserver.coordinator"},
    "rounds": {"fastapi", "starlette"},
    "coordinator": {"fastapi", "starlette"},
    "view": {"fastapi", "starlette", "syncserver.coordinator", "syncserver.rounds"},
}


def imports(module: str) -> set[str]:
    """Every module ``syncserver.<module>`` imports, as dotted names (top level and functions)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "syncserver":  # from syncserver import aggregate
                found |= {f"syncserver.{alias.name}" for alias in node.names}
    return found


def internal_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {
        m: {name.removeprefix("syncserver.") for name in imports(m) if name.removeprefix("syncserver.") in modules}
        - {m}
        for m in modules
    }


def test_the_hub_imports_no_cycles() -> None:
    graph = internal_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycle = [*path[path.index(dep) :], dep] if dep in path else [module, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_each_layer_imports_only_what_is_below_it(module: str) -> None:
    found = imports(module)
    for rule in FORBIDDEN[module]:
        if rule.endswith(".*"):
            bad = {name for name in found if name.startswith(rule[:-1])}
        else:
            bad = {name for name in found if name == rule or name.startswith(rule + ".")}
        assert not bad, f"syncserver/{module}.py imports {sorted(bad)}"


def test_the_hub_never_imports_torch_or_the_sdk() -> None:
    for path in PACKAGE.glob("*.py"):
        found = imports(path.stem)
        assert not {n for n in found if n.split(".")[0] in {"torch", "syncclient", "transformers"}}, path.name


def test_the_sdk_never_imports_the_hub() -> None:
    """``pip install 'weightsync[client]'`` has no hub: only the launcher (``weightsync_run``,
    for ``--local-peers``) may import it."""
    sdk = PACKAGE.parent / "syncclient"
    for path in sdk.rglob("*.py"):
        tree = ast.parse(path.read_text())
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {n for n in found if n.split(".")[0] == "syncserver"}, path.relative_to(sdk)
