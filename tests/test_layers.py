"""The hub's layers, read from its import statements: no cycles, and each layer imports only
what sits below it (the policy decides without I/O, the engine and store know no HTTP).

``syncserver/`` is four sub-packages, bottom to top: ``storage`` (keys, handles, durability),
``reduce`` (fold, merge, outer step), ``core`` (runs, rounds, policies, the read-only run view),
``api`` (HTTP: routes, response models, pages). Beside them at the top level: the modules every
layer shares (settings, errors, limits, names), which import no layer, and the process entry
points (app, cli, ...), which may import any. docs/concepts/architecture.md has the map."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "syncserver"

#: each layer and the layers it may import
LAYERS = {
    "storage": set(),
    "reduce": {"storage"},
    "core": {"storage", "reduce"},
    "api": {"storage", "reduce", "core"},
}
#: top-level modules every layer may import: they import no layer themselves
SHARED = {"settings", "errors", "limits", "names", "records"}
#: top-level process machinery: imports no layer either (the launcher and the CLI start a hub
#: through ``syncserver.app`` or a subprocess)
PROCESS = {"arenas", "process", "status", "workdirs"}
#: process entry points, which wire the layers together
ENTRY = {"__init__", "__main__", "app", "cli", "local"}
#: HTTP frameworks: the api layer's alone (``app`` names FastAPI for ``app``'s type only)
HTTP = {"fastapi", "starlette"}

# what single modules may not import, beyond their layer's rule (module names, or prefixes)
FORBIDDEN = {
    "core.policy": {"syncserver.*", "fastapi", "starlette", "numpy", "sqlite3", "os", "time"},
    "reduce.aggregate": {"syncserver.*", "fastapi", "starlette"},
    "core.view": {"syncserver.core.coordinator", "syncserver.core.rounds"},
    # the pages read the run view, never the store's records
    "api.dashboard": {"syncserver.storage.*", "syncserver.reduce.*"},
    "api.metrics": {"syncserver.storage.*", "syncserver.reduce.*"},
    # the response models are the wire format: plain pydantic over the core's enums and settings
    "api.schemas": {"syncserver.storage.*", "syncserver.reduce.*", "syncserver.api.*"},
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


def test_every_module_has_a_place() -> None:
    """A new module goes into a layer, or is named here as shared, process or entry point: the
    top level does not grow flat again."""
    top = {m for m in modules() if "." not in m} - set(LAYERS)
    assert top == SHARED | PROCESS | ENTRY, f"not placed: {sorted(top - SHARED - PROCESS - ENTRY)}"
    assert {m.split(".")[0] for m in modules() if "." in m} == set(LAYERS)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer: str) -> None:
    others = set(LAYERS) - LAYERS[layer] - {layer}
    rules = {f"syncserver.{other}.*" for other in others} | {f"syncserver.{entry}" for entry in ENTRY - {"__init__"}}
    if layer != "api":
        rules |= HTTP
    for module in sorted(m for m in modules() if m.split(".")[0] == layer):
        bad = _violations(module, rules)
        assert not bad, f"syncserver.{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(SHARED | PROCESS))
def test_shared_modules_import_no_layer(module: str) -> None:
    bad = _violations(module, {f"syncserver.{layer}.*" for layer in LAYERS} | HTTP)
    assert not bad, f"syncserver.{module} imports {sorted(bad)}"


def test_only_the_api_and_its_entry_point_speak_http() -> None:
    speaking = {m for m in modules() if _violations(m, HTTP)}
    assert {m for m in speaking if not m.startswith("api.")} == {"app"}, sorted(speaking)


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_single_modules_keep_their_own_rules(module: str) -> None:
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
