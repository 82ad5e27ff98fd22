"""The ext_proc picker's disaggregation (llm-d's sidecar mode) over real loopback gRPC: the
same rules as the HTTP gateway's (router/scheduling/disagg.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import orjson
import pytest

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.extproc.server import RunningEpp, running_epp
from tests.gateways import MODEL
from tests.router.extproc.envoy import Envoy, chat_body, epp_config, eventually, in_flight

PREFILLER = "x-prefiller-host-port"
LONG = "long prompt " * 600


@asynccontextmanager
async def _disagg_epp() -> AsyncIterator[tuple[RunningEpp, Envoy, set[str]]]:
    """A picker over 2 prefill and 2 decode replicas; yields it, Envoy and the decode ids."""
    async with start_replicas(4, SimConfig(speed=20.0)) as reps:
        roles = ["prefill", "prefill", "decode", "decode"]
        endpoints = [{"url": r.url, "role": role} for r, role in zip(reps, roles, strict=True)]
        config = epp_config(
            reps, pool={"endpoints": endpoints},
            disaggregation={"enabled": True, "nonCachedTokens": 256},
        )
        decode_ids = {f"{r.host}:{r.port}" for r in reps[2:]}
        async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
            yield epp, Envoy(channel), decode_ids


async def test_the_decode_lease_after_a_remote_prefill_counts_no_prompt_prefill() -> None:
    """The decode endpoint pulls the prompt's KV: its lease counts one token of prefill, not
    the prompt (which the prefill endpoint computes), as the HTTP gateway's does."""
    async with _disagg_epp() as (epp, envoy, decode_ids):
        call, routed = await envoy.send_request(chat_body(LONG, stream=True))
        prefill = routed.set_header(PREFILLER)
        assert prefill is not None and routed.header in decode_ids
        decode_state, prefill_state = epp.gateway.pool.get(routed.header), epp.gateway.pool.get(
            prefill
        )
        assert decode_state is not None and prefill_state is not None
        assert decode_state.pending_prefill_tokens <= 1
        assert prefill_state.pending_prefill_tokens > 256
        await envoy.finish(call)
        await eventually(lambda: in_flight(epp) == 0)


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}],
                                  "prompt_logprobs": 1}),
        ("/v1/completions", {"prompt": LONG, "echo": True, "logprobs": 1}),
    ],
)
async def test_a_request_for_its_prompt_logprobs_goes_to_decode_alone(
    path: str, payload: dict[str, Any]
) -> None:
    """A decode endpoint fed a pulled KV cache has no prompt logits: no prefiller is named."""
    async with _disagg_epp() as (epp, envoy, decode_ids):
        body = orjson.dumps({"model": MODEL, "max_tokens": 4, **payload})
        call, routed = await envoy.send_request(body, path=path)
        assert routed.header in decode_ids
        assert routed.set_header(PREFILLER) is None
        assert in_flight(epp) == 1  # no prefill endpoint counted for it
        await envoy.finish(call)
        await eventually(lambda: in_flight(epp) == 0)


async def test_a_prefiller_gone_before_its_lease_means_decode_alone() -> None:
    """The prefill endpoint left the pool while the prefill pool was ranked: the request goes
    to the decode endpoint alone, not a 500 (as on the HTTP gateway)."""
    async with _disagg_epp() as (epp, envoy, decode_ids):
        disagg = epp.gateway.proxy.disagg
        assert disagg is not None
        choose = disagg.choose_prefiller

        async def leaving(
            routing: RoutingRequest, decode: EndpointSnapshot
        ) -> tuple[RoutingRequest, EndpointSnapshot] | None:
            chosen = await choose(routing, decode)
            assert chosen is not None
            epp.gateway.pool.remove(chosen[1].id)
            return chosen

        disagg.choose_prefiller = leaving  # type: ignore[method-assign]
        call, routed = await envoy.send_request(chat_body(LONG, stream=True))
        assert routed.immediate is None
        assert routed.header in decode_ids
        assert routed.set_header(PREFILLER) is None
        state = epp.gateway.pool.get(routed.header)
        assert state is not None and state.pending_prefill_tokens > 256  # it prefills itself
        await envoy.finish(call)
        await eventually(lambda: in_flight(epp) == 0)
