"""The hub's layers, read from its import statements: no cycles, and each layer imports only
what sits below it (the policy decides without I/O, the engine and store know no HTTP)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "syncserver"

# what each module may not import (module names, or prefixes of third-party packages)
FORBIDDEN = {
    "core.policy": {"syncserver.*", "fastapi", "starlette", "numpy", "sqlite3", "os", "time"},
    "reduce.aggregate": {"syncserver.*", "fastapi", "starlette"},
    "reduce.engine": {"syncserver.core.*", "syncserver.api.*", "fastapi", "starlette"},
    "storage.store": {"syncserver.core.*", "syncserver.reduce.*", "fastapi", "starlette"},
    "storage.uploads": {"syncserver.core.*", "fastapi", "starlette"},
    "core.rounds": {"fastapi", "starlette"},
    "core.coordinator": {"fastapi", "starlette"},
    "core.view": {"fastapi", "starlette", "syncserver.core.coordinator", "syncserver.core.rounds"},
}


def modules() -> dict[str, Path]:
    """Every module of the hub by dotted name below ``syncserver`` (``core.policy``, ``cli``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def imports(module: str) -> set[str]:
    """Every module ``syncserver.<module>`` imports, as dotted names (top level and functions)."""
    tree = ast.parse(modules()[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module.split(".")[0] == "syncserver":  # from syncserver.reduce import aggregate
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def internal_graph() -> dict[str, set[str]]:
    known = set(modules())
    return {
        m: {name.removeprefix("syncserver.") for name in imports(m) if name.removeprefix("syncserver.") in known} - {m}
        for m in known
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


def _violations(module: str, rules: set[str]) -> set[str]:
    found = imports(module)
    bad: set[str] = set()
    for rule in rules:
        if rule.endswith(".*"):
            bad |= {name for name in found if name.startswith(rule[:-1])}
        else:
            bad |= {name for name in found if name == rule or name.startswith(rule + ".")}
    return bad


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_each_layer_imports_only_what_is_below_it(module: str) -> None:
    bad = _violations(module, FORBIDDEN[module])
    assert not bad, f"syncserver.{module} imports {sorted(bad)}"


def test_the_hub_never_imports_torch_or_the_sdk() -> None:
    for module, path in modules().items():
        found = imports(module)
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
