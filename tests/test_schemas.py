"""The OpenAPI schema describes every answer, closely enough that a client can be generated from it.

schemathesis (``test_schemathesis.py``) checks that answers match the schema; this checks that
the schema says something: no success answer without a described body, no free-form object
inside one.
"""

from __future__ import annotations

from typing import Any

from tests.conftest import Hub
from tests.harness import HTTP

#: The one success answer that is neither JSON nor safetensors: Prometheus' text format.
TEXT_ANSWERS = {"/metrics"}
PRIMITIVES = {"string", "integer", "number", "boolean", "null"}


def closed(schema: dict[str, Any], components: dict[str, Any], where: str) -> None:
    """Fail unless ``schema`` types every value it can hold: objects name their fields (or
    type their values, for maps), arrays type their items, unions type each branch."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        component = components[name]
        if "enum" in component:  # a named set of strings (PeerState)
            assert component.get("type") == "string", f"{where}: {name} is an enum of anything"
            return
        assert component.get("additionalProperties") is False, f"{where}: {name} takes any extra field"
        for field, sub in component["properties"].items():
            closed(sub, components, f"{where}.{field}")
    elif "anyOf" in schema or "oneOf" in schema:
        for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
            closed(branch, components, where)
    elif schema.get("type") == "array":
        items = schema.get("prefixItems", []) + ([schema["items"]] if "items" in schema else [])
        assert items, f"{where}: an array of anything"
        for item in items:
            closed(item, components, f"{where}[]")
    elif schema.get("type") == "object":
        values = schema.get("additionalProperties")
        assert isinstance(values, dict), f"{where}: an object of anything"
        closed(values, components, f"{where}{{}}")
    else:
        assert schema.get("type") in PRIMITIVES, f"{where}: untyped {schema}"


def test_openapi_describes_every_answer(hub: Hub) -> None:
    schema = HTTP.get(f"{hub.url}/openapi.json").json()
    components = schema["components"]["schemas"]
    described = 0
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if not status.startswith("2") or status == "204" or path in TEXT_ANSWERS:
                    continue
                where = f"{method.upper()} {path} {status}"
                content = response.get("content")
                assert content, f"{where}: no body described"
                for media, body in content.items():
                    assert media in ("application/json", "application/octet-stream"), where
                    if media == "application/json":
                        closed(body["schema"], components, where)
                        described += 1
    # healthz, runs, status, join, start, version 0, progress, heartbeat, leave, update (200 and
    # 202: held for its digest), an update through the object store (presign, uploaded), dashboard;
    # a reducer's lease, its renewal, the reducers
    assert described == 17
