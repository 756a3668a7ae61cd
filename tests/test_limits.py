"""The bounds of run settings are one set (:mod:`syncserver.limits`): the hub's defaults
(``SYNC_*``, ``serve``'s flags) and a peer's join accept exactly the same values."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from syncserver.api.routes import JoinRequest
from syncserver.limits import MAX_PEERS
from syncserver.settings import HubSettings

EDGES: list[object] = [
    -1, 0, 1e-300, 0.5, 0.7, 0.9999, 1, 1.0000001, 2, 10, 10.000001, 1e6, 1e6 + 1, 604800, 604801,
    8192, 8193, 1e38, math.inf, -math.inf, math.nan, 2**64,
]  # fmt: skip


def accepts(model: type, field: str, value: object) -> bool:
    try:
        if model is JoinRequest:
            JoinRequest(peer="p", **{field: value})
        else:  # min_peers is also checked against the hub's peer quota: at its bound here
            HubSettings(**{field: value}, max_peers_per_run=MAX_PEERS)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("field", ["outer_lr", "outer_momentum", "min_peers", "round_timeout", "norm_guard"])
def test_a_join_and_the_hub_settings_agree_on_every_bound(field: str) -> None:
    verdicts = {repr(v): (accepts(JoinRequest, field, v), accepts(HubSettings, field, v)) for v in EDGES}
    assert all(join == hub for join, hub in verdicts.values()), verdicts
    for value in (math.inf, -math.inf, math.nan, 1e38, 2**64):
        assert not accepts(HubSettings, field, value), f"{field}={value} is accepted"


def test_codecs_are_compared_in_one_spelling() -> None:
    assert JoinRequest(peer="p", codec="int8:block=64").codec == "int8"
    assert HubSettings(codec="int4:block=128").codec == "int4"
    assert JoinRequest(peer="p", codec="int8:block=32").codec == "int8:block=32"
