"""Discovery's pure parts: a pod's endpoints, the config's one source, the live pool's
bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.model import parse_config
from router.core.endpoints import Endpoint, EndpointPool
from router.core.errors import ConfigError
from router.pool.discovery import LivePool, pod_endpoints
from tests.router.pool.test_discovery import discovery_config, pod


def test_pod_endpoints() -> None:
    config = discovery_config("http://127.0.0.1:1", labelSelector={}, targetPorts=[8000, 8001])
    roles = {"prefill": "prefill", "decode": "decode", "prefill-decode": "both", "odd": "both"}
    for label, role in roles.items():
        found = pod_endpoints(pod("p", "127.0.0.5", **{"llm-d.ai/role": label}), [8000], config)
        assert [(e.id, e.role, r) for e, r in found] == [("127.0.0.5:8000", role, True)]
    six = pod_endpoints(pod("p", "fd00::5"), [8000, 8001], config)
    assert [e.id for e, _ in six] == ["[fd00::5]:8000", "[fd00::5]:8001"]
    leaving = pod("p", "127.0.0.5")
    leaving["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert [r for _, r in pod_endpoints(leaving, [8000], config)] == [False]
    pending = pod("p", "")
    assert pod_endpoints(pending, [8000], config) == []


@pytest.mark.parametrize(
    "section",
    [
        {},
        {"inferencePool": "a", "labelSelector": {"a": "b"}},
        {"labelSelector": {"a": "b"}},
        {"inferencePool": "a", "targetPorts": [8000]},
    ],
)
def test_config_wants_one_source(section: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="discovery"):
        parse_config({"discovery": section})


async def test_live_pool_keeps_static_endpoints_and_forgets_deleted_ones() -> None:
    static = Endpoint.from_url("http://127.0.0.1:7000")
    pool = EndpointPool([static])
    forgotten: list[str] = []

    async def forget(endpoint_id: str) -> None:
        forgotten.append(endpoint_id)

    live = LivePool(pool, None, [forget])
    a = Endpoint.from_url("http://127.0.0.11:8000")
    await live.apply({a.id: (a, True), static.id: (static, True)})
    assert {s.endpoint.id for s in pool} == {static.id, a.id}
    assert pool.get(a.id) is not None and pool.get(a.id).healthy  # type: ignore[union-attr]
    await live.apply({a.id: (a, False)})  # unready: out of the pool, index kept
    assert {s.endpoint.id for s in pool} == {static.id} and forgotten == []
    await live.apply({})
    assert forgotten == [a.id]
    assert {s.endpoint.id for s in pool} == {static.id}
