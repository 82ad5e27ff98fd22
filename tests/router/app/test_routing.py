"""The scheduling half of the composition root (router/app/routing.py)."""

from __future__ import annotations

import asyncio

from flow_control.request import FlowRequest
from router.app import build_gateway
from router.config.model import parse_config


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
