"""Coding agents' session headers: affinity and fairness follow them
(router/protocol/agent_identity.py).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from flow_control.config import FlowControlConfig
from flow_control.controller import FlowController
from flow_control.request import Ticket
from flow_control.resolve import MAX_ID_CHARS
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot
from router.core.errors import ConfigError
from router.protocol.agent_identity import AGENT_SESSION_HEADERS, AgentIdentity
from router.serve.server import running_gateway
from tests.gateways import MODEL, gateway_config


def test_explicit_session_header_wins_then_operator_headers_then_the_agents() -> None:
    identity = AgentIdentity(["X-Team-Session"])
    every = {
        "x-session-id": "explicit", "x-team-session": "team",
        **{h: h for h in AGENT_SESSION_HEADERS},
    }
    found = identity.identify(every, hint="body")
    assert (found.session, found.agent) == ("explicit", "team")
    del every["x-session-id"]
    assert identity.identify(every).session == "team"
    del every["x-team-session"]
    for header in AGENT_SESSION_HEADERS:  # in the documented order
        assert identity.identify(every).session == header
        del every[header]
    assert identity.identify(every, hint="body").session == "body"
    assert identity.identify({"session_id": "  "}).session is None


def test_agent_headers_can_be_turned_off_and_names_are_checked() -> None:
    identity = AgentIdentity(["x-mine"], agent_headers=False)
    assert identity.identify({"x-claude-code-session-id": "c"}).session is None
    assert identity.identify({"x-mine": "m"}).agent == "m"
    config = parse_config({"sessionAffinity": {"headers": ["X-Mine"]}})
    assert config.session_affinity.headers == ["x-mine"]
    with pytest.raises(ConfigError, match=r"sessionAffinity\.headers: .*not an HTTP header"):
        parse_config({"sessionAffinity": {"headers": ["bad header"]}})


def _turn(i: int) -> str:
    return f"new unrelated task {i}: " + " ".join(f"w{i * 97 + j}" for j in range(60))


@pytest.mark.slow
async def test_each_agent_header_keeps_a_session_on_one_replica(
    replicas: list[Replica],
) -> None:
    """An agent resends its whole conversation each turn; the header makes the turns one
    session: the decision shows the session's home (its affinity term) from turn two on."""
    config = gateway_config([r.url for r in replicas], server={"port": 0, "explainHeader": True})
    async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:

        async def send(headers: dict[str, str], messages: list[dict[str, str]]) -> str:
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            asked = {**headers, "x-prefixgate-explain": "1"}
            r = await http.post("/v1/chat/completions", json=body, headers=asked)
            assert r.status_code == 200, r.text
            decision = orjson.loads(r.headers["x-prefixgate-decision"])
            pick = decision["endpoints"][0]["ttft-cost-scorer.terms"]
            homes.append((r.headers["x-gateway-destination-endpoint"],
                          pick["affinity_bonus_s"] > 0))
            messages.append({"role": "assistant", "content": r.json()["choices"][0][
                "message"]["content"]})
            return str(r.headers["x-gateway-destination-endpoint"])

        for n, header in enumerate(AGENT_SESSION_HEADERS):
            homes: list[tuple[str, bool]] = []
            messages: list[dict[str, str]] = []
            for i in range(8):
                messages.append({"role": "user", "content": _turn(n * 100 + i)})
                await send({header: f"agent-{n}"}, messages)
            assert len({home for home, _ in homes}) == 1, (header, homes)
            assert [known for _, known in homes] == [False] + [True] * 7, (header, homes)


@pytest.mark.slow
async def test_sixteen_agent_sessions_spread_over_the_pool_and_stay_home() -> None:
    """Sixteen agents start at once (their first requests overlap: each decodes for seconds),
    so they spread; each one's second turn goes back where its first went."""
    async with start_replicas(4, SimConfig(itl_ms=50.0)) as replicas:
        config = gateway_config([r.url for r in replicas])
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:

            async def turn(session: int, messages: list[dict[str, str]], tokens: int) -> str:
                body = {"model": MODEL, "messages": messages, "max_tokens": tokens}
                headers = {"x-claude-code-session-id": f"s{session}"}
                r = await http.post("/v1/chat/completions", json=body, headers=headers, timeout=60)
                assert r.status_code == 200, r.text
                answer = r.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": answer})
                return str(r.headers["x-gateway-destination-endpoint"])

            chats = [[{"role": "user", "content": _turn(1000 + i)}] for i in range(16)]
            firsts = await asyncio.gather(*(turn(i, chats[i], 60) for i in range(16)))
            seconds = []
            for i, chat in enumerate(chats):
                chat.append({"role": "user", "content": _turn(2000 + i)})
                seconds.append(await turn(i, chat, 2))
    spread = Counter(firsts)
    assert len(spread) == len(replicas) and min(spread.values()) >= 2, spread
    assert seconds == firsts


def _one_endpoint(model: str) -> list[EndpointSnapshot]:
    return [
        EndpointSnapshot(
            id="e", url="http://e:8000", role="both", in_flight=0, pending_prefill_tokens=0,
            waiting=0.0, running=0.0, kv_usage=0.0, metrics_age=math.inf,
        )
    ]


async def _dispatch_order(identity: AgentIdentity) -> list[str]:
    """Agent A floods 10 requests, then agent B sends 2, into a pool that serves one at a
    time; returns who was dispatched in which order."""
    config = FlowControlConfig.model_validate(
        {"saturationDetector": {"inFlightThreshold": 1}, "defaultRequestTTL": 10_000}
    )
    ctl = FlowController(config, _one_endpoint, clock=lambda: 0.0, registry=CollectorRegistry())
    order: list[str] = []
    inbox: asyncio.Queue[Ticket] = asyncio.Queue()

    async def client(who: str, headers: dict[str, str]) -> None:
        found = identity.identify(headers)
        request = ctl.build_request(headers, "m", default_fairness=found.agent)
        ticket = await ctl.admit(request)
        order.append(who)
        await inbox.put(ticket)

    async def server(total: int) -> None:
        for _ in range(total):
            (await inbox.get()).release()

    clients = [client("A", {"x-claude-code-session-id": "agent-a"}) for _ in range(10)]
    clients += [client("B", {"session-id": "agent-b"}) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(server(12), *clients), timeout=10)
    return order


async def test_fairness_follows_the_agent_header() -> None:
    fair = await _dispatch_order(AgentIdentity())
    # B's two requests are served within the first rounds, not after A's burst.
    assert [i for i, who in enumerate(fair) if who == "B"] == [2, 4]
    shared = await _dispatch_order(AgentIdentity(agent_headers=False))
    assert [i for i, who in enumerate(shared) if who == "B"] == [10, 11]


def test_an_explicit_fairness_header_wins_over_the_agent() -> None:
    ctl = FlowController(FlowControlConfig(), _one_endpoint, registry=CollectorRegistry())
    headers = {"x-gateway-inference-fairness-id": "tenant", "session-id": "agent"}
    found = AgentIdentity().identify(headers)
    assert ctl.build_request(headers, "m", default_fairness=found.agent).fairness_id == "tenant"
    assert ctl.build_request({}, "m", default_fairness="agent").fairness_id == "agent"


def test_a_body_session_key_is_cut_as_the_headers_are() -> None:
    """metadata.user_id or prompt_cache_key, of any length a client sends, keys an affinity
    entry and a Redis key: no longer than a header's id."""
    identity = AgentIdentity().identify({}, "  " + "k" * 1_000_000 + " ")
    assert identity.session == "k" * MAX_ID_CHARS
    assert AgentIdentity().identify({}, "   ").session is None
