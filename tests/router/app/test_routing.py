"""The scheduling half of the composition root (router/app/routing.py)."""

from __future__ import annotations

import asyncio

import pytest

from flow_control.request import FlowRequest
from router.app import build_gateway
from router.config.model import parse_config
from router.core.endpoints import EndpointSnapshot
from router.core.errors import ConfigError
from router.core.framework import RoutingRequest


async def test_with_disaggregation_flow_control_counts_only_the_decode_pool() -> None:
    """Short and cached prompts never reach the prefill pool: an idle prefill endpoint is no
    room for them, or the pool never counts as saturated and nothing is ever prioritised."""
    endpoints = [
        {"url": "http://127.0.0.1:1", "role": "prefill", "models": ["m"]},
        {"url": "http://127.0.0.1:2", "role": "decode", "models": ["m"]},
    ]
    gw = build_gateway(parse_config({
        "pool": {"endpoints": endpoints},
        "flowControl": {"enabled": True},
        "disaggregation": {"enabled": True},
    }))
    for state in gw.pool:
        state.healthy = True
    decode = next(s for s in gw.pool if s.endpoint.role == "decode")
    assert gw.flow.limits is not None
    leases = [
        gw.pool.lease(decode.endpoint.id, 100)
        for _ in range(gw.flow.limits.limit(decode.endpoint.id))
    ]
    waiting = asyncio.create_task(gw.flow.admit(FlowRequest(model="m")))
    await asyncio.sleep(0)
    assert gw.flow.queued == 1, "queued: the decode endpoint is at its limit"
    leases[0].release()
    gw.flow.poke()  # as a first byte or a scrape does
    ticket = await asyncio.wait_for(waiting, 5)
    ticket.release()
    for lease in leases[1:]:
        lease.release()


def snapshot(eid: str) -> EndpointSnapshot:
    return EndpointSnapshot(eid, f"http://{eid}", "prefill", 0, 0, 0.0, 0.0, 0.0, 0.0)


def test_the_prefill_profiles_scorers_learn_its_picks() -> None:
    """Each profile has its own plugin instances: a no-hit-lru-scorer of the prefill profile
    must hear of prefill picks, or every cold prefill goes to the same endpoint."""
    config = parse_config({
        "pool": {"endpoints": [
            {"url": "http://p1:8000", "role": "prefill"},
            {"url": "http://p2:8000", "role": "prefill"},
            {"url": "http://d1:8000", "role": "decode"},
        ]},
        "disaggregation": {"enabled": True},
        "plugins": [{"type": "no-hit-lru-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "no-hit-lru-scorer"},
                                            {"pluginRef": "max-score-picker"}]},
            {"name": "decode", "plugins": [{"pluginRef": "no-hit-lru-scorer"},
                                           {"pluginRef": "max-score-picker"}]},
        ],
        "seed": 0,
    })
    gateway = build_gateway(config)
    assert gateway.proxy.disagg is not None
    prefill = gateway.proxy.disagg._profile
    pool = [snapshot("p1:8000"), snapshot("p2:8000")]
    picks = []
    for i in range(4):
        request = RoutingRequest(f"r{i}", "m")  # cold: no hits, no session home
        pick = prefill.run(request, pool).ranked[0].id
        gateway.router.picked(request, pick)  # what Disaggregator.prepare does after the pick
        picks.append(pick)
    assert len(set(picks)) == 2, f"every cold prefill went to {picks}"


def test_a_bad_entry_of_the_decode_profile_is_named_at_its_own_index() -> None:
    """Without disaggregation the profile named decode runs: an error in it names its index,
    not schedulingProfiles[0]."""
    config = parse_config({
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "queue-scorer"}]},
            {"name": "decode", "plugins": [{"pluginRef": "max-score-picker", "weight": 2}]},
        ],
    })
    with pytest.raises(ConfigError, match=r"^schedulingProfiles\[1\]\.plugins\[0\]\.weight"):
        build_gateway(config)


def test_a_profile_that_does_not_run_is_checked_too() -> None:
    """Without disaggregation only the decode profile runs; a typo in the other one still
    fails at start-up instead of waiting for the day disaggregation is turned on."""
    config = parse_config({
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "queue-scorerr"}]},
            {"name": "decode", "plugins": [{"pluginRef": "queue-scorer"}]},
        ],
    })
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins\[0\]\.pluginRef"):
        build_gateway(config)
