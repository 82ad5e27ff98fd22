"""Discovery's pure parts: a pod's endpoints, the config's one source, the live pool's
bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from router.config.model import parse_config
from router.core.endpoints import Endpoint
from router.core.errors import ConfigError
from router.core.pool import EndpointPool
from router.pool.discovery import Found, KubernetesDiscovery, LivePool, pod_endpoints
from tests.router.pool.test_discovery import Recorder, discovery_config, pod


def test_pod_endpoints() -> None:
    config = discovery_config("http://127.0.0.1:1", labelSelector={}, targetPorts=[8000, 8001])
    roles = {"prefill": "prefill", "decode": "decode", "prefill-decode": "both", "odd": "both"}
    for label, role in roles.items():
        found = pod_endpoints(pod("p", "127.0.0.5", **{"llm-d.ai/role": label}), [8000], config)
        assert [(f.endpoint.id, f.endpoint.role, f.ready) for f in found] == [
            ("127.0.0.5:8000", role, True)
        ]
    six = pod_endpoints(pod("p", "fd00::5"), [8000, 8001], config)
    assert [f.endpoint.id for f in six] == ["[fd00::5]:8000", "[fd00::5]:8001"]
    leaving = pod("p", "127.0.0.5")
    leaving["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert [f.ready for f in pod_endpoints(leaving, [8000], config)] == [False]
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
    await live.apply({a.id: Found(a, True), static.id: Found(static, True)})
    assert {s.endpoint.id for s in pool} == {static.id, a.id}
    assert pool.get(a.id) is not None and pool.get(a.id).healthy  # type: ignore[union-attr]
    await live.apply({a.id: Found(a, False)})  # unready: out of the pool, index kept
    assert {s.endpoint.id for s in pool} == {static.id} and forgotten == []
    await live.apply({})
    assert forgotten == [a.id]
    assert {s.endpoint.id for s in pool} == {static.id}


def test_a_pods_endpoints_name_the_pod() -> None:
    """By its uid (a pod deleted and created again under its name is another one), else its
    name."""
    config = discovery_config("http://127.0.0.1:1", labelSelector={}, targetPorts=[8000])
    named = pod("p", "127.0.0.5")
    assert [f.pod for f in pod_endpoints(named, [8000, 8001], config)] == ["p", "p"]
    named["metadata"]["uid"] = "6f1c"
    assert [f.pod for f in pod_endpoints(named, [8000], config)] == ["6f1c"]


def test_of_two_pods_at_one_address_the_one_on_its_way_in_is_seen() -> None:
    """An evicted pod stays listed with its IP, which a new pod may have: the new one is the
    endpoint whatever the listing's order, so a readiness blip of the new one does not flip
    the address to the evicted pod (and back), forgetting what was learned each time."""
    config = discovery_config("http://127.0.0.1:1", labelSelector={}, targetPorts=[8000])
    discovery = KubernetesDiscovery(config, Recorder())
    evicted = pod("evicted", "127.0.0.11", ready=False)
    evicted["status"]["phase"] = "Failed"
    terminating = pod("terminating", "127.0.0.11", ready=False)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    arriving = pod("new", "127.0.0.11", ready=False)
    for pods in ([evicted, terminating, arriving], [arriving, terminating, evicted]):
        found = discovery._endpoints({p["metadata"]["name"]: p for p in pods}, [8000])
        assert found["127.0.0.11:8000"].pod == "new"


async def test_the_live_pool_forgets_an_address_another_pod_now_has() -> None:
    pool = EndpointPool()
    forgotten: list[str] = []

    async def forget(endpoint_id: str) -> None:
        forgotten.append(endpoint_id)

    live = LivePool(pool, None, [forget])
    a = Endpoint.from_url("http://127.0.0.11:8000")
    await live.apply({a.id: Found(a, True, "old")})
    old = pool.get(a.id)
    await live.apply({a.id: Found(a, True, "new")})  # no event between: both ready in turn
    assert forgotten == [a.id]
    assert pool.get(a.id) is not None and pool.get(a.id) is not old
    await live.apply({a.id: Found(a, False, "new")})  # a readiness blip: nothing forgotten
    await live.apply({a.id: Found(a, True, "new")})
    assert forgotten == [a.id]
