"""The ext_proc endpoint picker over real loopback gRPC: shedding, releases, health and
shutdown, the command line, disaggregation and the agent APIs."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.extproc.server import RunningEpp, running_epp
from tests.gateways import MODEL
from tests.router.extproc.envoy import (
    MODE,
    Envoy,
    _headers,
    chat_body,
    epp_config,
    eventually,
    in_flight,
)


async def test_readiness_drops_at_shutdown(two_replicas: list[Replica]) -> None:
    async with running_epp(epp_config(two_replicas)) as epp:
        health = epp.health
    reply = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), None)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_cli_runs_the_picker_until_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text("extProc: {healthPort: 0, metricsPort: 0}\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "epp",
        "--config",
        str(config),
        "--port",
        "0",
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            while not (line := (await proc.stderr.readline()).decode()).count("ext_proc on"):
                assert line, "the picker exited before serving"
        target = re.search(r"ext_proc on (\S+),", line)
        assert target is not None
        async with grpc.aio.insecure_channel(target.group(1)) as channel:
            _, routed = await Envoy(channel).send_request(chat_body("hi"))
        reply = routed.immediate  # no endpoint configured: the picker answers, Envoy replies
        assert reply is not None and reply.status.code == 404
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_body_mode_that_cannot_route_is_refused(envoy: Envoy) -> None:
    call = envoy._stub.Process()
    first = pb.ProcessingRequest(request_headers=_headers({":path": "/v1/chat/completions"}))
    first.protocol_config.request_body_mode = MODE.STREAMED
    await call.write(first)
    reply = (await call.read()).immediate_response
    assert reply.status.code == 500
    assert b"FULL_DUPLEX_STREAMED or BUFFERED" in reply.body


async def test_disaggregation_names_the_prefiller_for_the_decode_sidecar() -> None:
    """Envoy reaches one destination: with P/D the decode pick carries x-prefiller-host-port."""
    async with start_replicas(4, SimConfig(speed=20.0)) as reps:
        roles = ["prefill", "prefill", "decode", "decode"]
        config = epp_config(
            reps,
            pool={
                "endpoints": [
                    {"url": r.url, "role": role} for r, role in zip(reps, roles, strict=True)
                ]
            },
            disaggregation={"enabled": True, "nonCachedTokens": 256},
        )
        prefill_ids = {f"{r.host}:{r.port}" for r in reps[:2]}
        decode_ids = {f"{r.host}:{r.port}" for r in reps[2:]}
        async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
            envoy = Envoy(channel)
            call, routed = await envoy.send_request(chat_body("long prompt " * 600))
            assert routed.header in decode_ids
            assert routed.set_header("x-prefiller-host-port") in prefill_ids
            await envoy.finish(call)
            call, routed = await envoy.send_request(chat_body("hi"))
            assert routed.header in decode_ids
            assert routed.set_header("x-prefiller-host-port") is None  # short: decode alone
            await envoy.finish(call)
            # The prefill step speaks chat and completions: an agent API's long prompt
            # goes to decode alone, with no prefill endpoint counted for it.
            long = [{"role": "user", "content": "an agent's own long prompt " * 400}]
            body = orjson.dumps({"model": MODEL, "max_tokens": 4, "messages": long})
            call, routed = await envoy.send_request(body, path="/v1/messages")
            assert routed.header in decode_ids
            assert routed.set_header("x-prefiller-host-port") is None
            assert in_flight(epp) == 1
            await envoy.finish(call)
            await eventually(lambda: in_flight(epp) == 0)


@pytest.mark.parametrize(
    ("path", "make"),
    [
        ("/v1/messages", lambda system, q: {"model": MODEL, "max_tokens": 5, "system": system,
                                            "messages": [{"role": "user", "content": q}]}),
        ("/v1/responses", lambda system, q: {"model": MODEL, "instructions": system,
                                             "input": q}),
    ],
)
async def test_agent_apis_are_routed_prefix_aware(
    epp: RunningEpp, envoy: Envoy, path: str, make: Any
) -> None:
    system = "You are a coding agent with many tools. " * 200
    picks = []
    for i in range(5):
        call, routed = await envoy.send_request(orjson.dumps(make(system, f"task {i}")), path=path)
        picks.append(routed.header)
        await envoy.finish(call)
    assert len(set(picks[1:])) == 1, picks
    assert epp.gateway.metrics.registry.get_sample_value(
        "prefixgate_extproc_decisions_total", {"outcome": "routed"}
    ) == 5


async def test_a_stored_response_is_fetched_where_it_lives(epp: RunningEpp, envoy: Envoy) -> None:
    routes = epp.gateway.router.responses
    assert routes is not None
    holder = sorted(s.endpoint.id for s in epp.gateway.pool)[1]
    routes.remember("resp_abc", holder)
    for path in ("/v1/responses/resp_abc", "/v1/responses/resp_abc/cancel"):
        call, routed = await envoy.send_request(None, path=path)
        assert routed.header == holder
        await envoy.finish(call)
    _, missing = await envoy.send_request(None, path="/v1/responses/resp_unknown")
    reply = missing.immediate
    assert reply is not None and reply.status.code == 404
    await eventually(lambda: in_flight(epp) == 0)


async def test_messages_errors_keep_the_anthropic_shape(envoy: Envoy) -> None:
    _, routed = await envoy.send_request(b"{not json", path="/v1/messages")
    reply = routed.immediate
    assert reply is not None and reply.status.code == 400
    body = orjson.loads(reply.body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


async def test_a_shed_messages_request_is_overloaded_in_anthropics_shape(
    two_replicas: list[Replica],
) -> None:
    """Anthropic's status for an overloaded service is 529, outside Envoy's HttpStatus enum:
    Envoy takes any code from 200 up, so the picker must still send it."""
    flow = {
        "saturationDetector": {"inFlightThreshold": 1},
        "objectives": [{"name": "batch", "priority": -1}],
    }
    config = epp_config(two_replicas[:1], flowControl=flow)
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        busy, _ = await envoy.send_request(chat_body("first"))
        body = orjson.dumps({"model": MODEL, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "second"}]})
        _, shed = await envoy.send_request(
            body, path="/v1/messages", headers={"x-gateway-inference-objective": "batch"}
        )
        reply = shed.immediate
        assert reply is not None and reply.status.code == 529
        headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
        assert headers["x-gateway-request-dropped-reason"] == "rejected-saturated"
        assert orjson.loads(reply.body)["error"]["type"] == "overloaded_error"
        await envoy.finish(busy)
        await eventually(lambda: in_flight(epp) == 0)
