"""The ext_proc endpoint picker over real loopback gRPC, with a client playing Envoy's part."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.extproc.server import EXT_PROC_SERVICE, RunningEpp, running_epp
from tests.gateways import MODEL, gateway_config

DEST = "x-gateway-destination-endpoint"
MiB = 1024 * 1024
GRPC_DEFAULT_LIMIT = 4 * MiB
MODE = processing_mode_pb2.ProcessingMode


def epp_config(replicas: Sequence[Replica], **overrides: Any) -> Any:
    ext_proc = {"port": 0, "healthPort": 0, "metricsPort": 0, **overrides.pop("extProc", {})}
    return gateway_config([r.url for r in replicas], extProc=ext_proc, **overrides)


def chat_body(text: str, **extra: Any) -> bytes:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}
    return orjson.dumps(payload)


def _headers(values: dict[str, str], end_of_stream: bool = False) -> Any:
    items = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=items), end_of_stream=end_of_stream)


def _body(data: bytes, end_of_stream: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def _subset_metadata(subset: Sequence[str]) -> Any:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": list(subset)})
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return metadata


@dataclass
class Routed:
    """What the picker answered to one request phase."""

    answers: list[Any] = field(default_factory=list)

    @property
    def immediate(self) -> Any | None:
        for a in self.answers:
            if a.HasField("immediate_response"):
                return a.immediate_response
        return None

    def _mutation_answer(self) -> Any:
        for a in self.answers:
            kind = a.WhichOneof("response")
            common = getattr(a, kind).response
            if any(h.header.key == DEST for h in common.header_mutation.set_headers):
                return a
        raise AssertionError("no answer carries the destination header")

    @property
    def header(self) -> str:
        a = self._mutation_answer()
        common = getattr(a, a.WhichOneof("response")).response
        values = [
            h.header.raw_value.decode()
            for h in common.header_mutation.set_headers
            if h.header.key == DEST
        ]
        assert len(values) == 1
        return values[0]

    def set_header(self, name: str) -> str | None:
        a = self._mutation_answer()
        common = getattr(a, a.WhichOneof("response")).response
        for h in common.header_mutation.set_headers:
            if h.header.key == name:
                return str(h.header.raw_value.decode())
        return None

    @property
    def metadata(self) -> str:
        meta = json_format.MessageToDict(self._mutation_answer().dynamic_metadata)
        value: str = meta["envoy.lb"][DEST]
        return value

    @property
    def body(self) -> bytes:
        return b"".join(
            a.request_body.response.body_mutation.streamed_response.body
            for a in self.answers
            if a.HasField("request_body")
        )


class Envoy:
    """Envoy's side of ext_proc streams: one stream per HTTP request."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pb_grpc.ExternalProcessorStub(channel)

    async def send_request(
        self,
        body: bytes | None,
        *,
        mode: str = "duplex",
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
        subset: Sequence[str] | None = None,
        chunk: int = 64 * 1024,
        announce_mode: bool = True,
    ) -> tuple[Any, Routed]:
        """Send a request phase as Envoy would and collect the picker's answers to it."""
        call = self._stub.Process()
        body_mode = MODE.FULL_DUPLEX_STREAMED if mode == "duplex" else MODE.BUFFERED
        first = pb.ProcessingRequest(
            request_headers=_headers(
                {":method": "POST" if body else "GET", ":path": path, **(headers or {})},
                end_of_stream=body is None,
            )
        )
        if announce_mode:
            first.protocol_config.request_body_mode = body_mode
            first.protocol_config.response_body_mode = body_mode
        if subset is not None:
            first.metadata_context.CopyFrom(_subset_metadata(subset))
        await call.write(first)
        routed = Routed()
        if body is None:
            routed.answers.append(await call.read())
            return call, routed
        if mode == "buffered":
            routed.answers.append(await call.read())  # headers let through first
            await call.write(_body(body, end_of_stream=True))
            routed.answers.append(await call.read())
            return call, routed
        for i in range(0, len(body), chunk):
            part = body[i : i + chunk]
            last = i + chunk >= len(body)
            await call.write(_body(part, end_of_stream=last))
        while True:
            answer = await call.read()
            assert answer is not grpc.aio.EOF, "stream ended before the body came back"
            routed.answers.append(answer)
            if answer.HasField("immediate_response"):
                return call, routed
            stream = answer.request_body.response.body_mutation.streamed_response
            if answer.HasField("request_body") and stream.end_of_stream:
                return call, routed

    async def finish(self, call: Any, status: str = "200", duplex: bool = True) -> None:
        """The response phase: headers, a body chunk with end of stream, then close."""
        await call.write(pb.ProcessingRequest(response_headers=_headers({":status": status})))
        assert (await call.read()).HasField("response_headers")
        done = pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)
        await call.write(pb.ProcessingRequest(response_body=done))
        answer = await call.read()
        if duplex:
            assert answer.response_body.response.body_mutation.streamed_response.end_of_stream
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


@pytest.fixture
async def two_replicas() -> AsyncIterator[list[Replica]]:
    async with start_replicas(2, SimConfig(speed=20.0)) as reps:
        yield reps


@pytest.fixture
async def epp(two_replicas: list[Replica]) -> AsyncIterator[RunningEpp]:
    async with running_epp(epp_config(two_replicas, flowControl={})) as running:
        yield running


@pytest.fixture
async def envoy(epp: RunningEpp) -> AsyncIterator[Envoy]:
    async with grpc.aio.insecure_channel(epp.target) as channel:
        yield Envoy(channel)


def in_flight(epp: RunningEpp) -> int:
    return sum(s.in_flight for s in epp.gateway.pool)


async def eventually(predicate: Any, seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 (state changed by the server's tasks)
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
@pytest.mark.parametrize("size", [2_000, 5 * MiB])
async def test_routes_small_and_large_bodies(
    epp: RunningEpp, envoy: Envoy, mode: str, size: int
) -> None:
    body = chat_body("x" * size)
    call, routed = await envoy.send_request(body, mode=mode)
    ids = {s.endpoint.id for s in epp.gateway.pool}
    assert routed.header in ids
    assert routed.metadata == routed.header
    if mode == "duplex":
        assert routed.body == body  # Envoy forwards only what is streamed back
    assert all(a.ByteSize() < GRPC_DEFAULT_LIMIT for a in routed.answers)
    assert in_flight(epp) == 1
    assert epp.gateway.flow.outstanding(MODEL) == 1
    await envoy.finish(call, duplex=mode == "duplex")
    await eventually(lambda: in_flight(epp) == 0 and epp.gateway.flow.outstanding(MODEL) == 0)


async def test_same_prefix_goes_to_the_same_endpoint(envoy: Envoy) -> None:
    prefix = "You are a helpful assistant. " * 200
    picks = []
    for i in range(6):
        call, routed = await envoy.send_request(chat_body(prefix + f"question {i}"))
        picks.append(routed.header)
        await envoy.finish(call)
    assert len(set(picks[1:])) == 1


async def test_body_mode_defaults_when_envoy_does_not_announce_it(
    two_replicas: list[Replica],
) -> None:
    config = epp_config(two_replicas, extProc={"defaultBodyMode": "BUFFERED"})
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        call, routed = await Envoy(channel).send_request(
            chat_body("hi"), mode="buffered", announce_mode=False
        )
        assert routed.answers[1].HasField("request_body")
        assert routed.header in {r.url.removeprefix("http://") for r in two_replicas}
        await Envoy(channel).finish(call, duplex=False)


async def test_subset_hint_limits_the_candidates(epp: RunningEpp, envoy: Envoy) -> None:
    ids = sorted(s.endpoint.id for s in epp.gateway.pool)
    for wanted in ids:
        for i in range(4):
            call, routed = await envoy.send_request(chat_body(f"q{i}"), subset=[wanted])
            assert routed.header == wanted
            await envoy.finish(call)
    host = ids[0].rsplit(":", 1)[0]  # a bare address matches every port on it
    call, routed = await envoy.send_request(chat_body("bare"), subset=[host])
    assert routed.header in ids
    await envoy.finish(call)


async def test_subset_hint_without_a_known_endpoint_is_a_503(envoy: Envoy) -> None:
    _, routed = await envoy.send_request(chat_body("hi"), subset=["10.255.0.1:8000"])
    reply = routed.immediate
    assert reply is not None and reply.status.code == 503
    headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
    assert headers["x-gateway-request-dropped-reason"] == "rejected-no-endpoints"
    assert orjson.loads(reply.body)["error"]["code"] == "no_endpoints"


async def test_fallback_list(two_replicas: list[Replica]) -> None:
    config = epp_config(two_replicas, extProc={"fallbackEndpoints": 1})
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        call, routed = await envoy.send_request(chat_body("hi"))
        first, second = routed.header.split(",")
        assert routed.metadata == routed.header and first != second
        leased = [s.endpoint.id for s in epp.gateway.pool if s.in_flight]
        assert leased == [first]  # only the pick is counted
        await envoy.finish(call)


async def test_shed_requests_get_an_immediate_response(two_replicas: list[Replica]) -> None:
    flow = {
        "saturationDetector": {"inFlightThreshold": 1},
        "objectives": [{"name": "batch", "priority": -1}],
        "defaultRequestTTL": 30,
    }
    config = epp_config(two_replicas[:1], flowControl=flow)
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        busy, _ = await envoy.send_request(chat_body("first"))
        # Saturated now: a sheddable request is turned away at once ...
        _, shed = await envoy.send_request(
            chat_body("second"), headers={"x-gateway-inference-objective": "batch"}
        )
        reply = shed.immediate
        assert reply is not None and reply.status.code == 429
        headers = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
        assert headers["x-gateway-request-dropped-reason"] == "rejected-saturated"
        assert headers["content-type"] == "application/json"
        assert orjson.loads(reply.body)["error"]["type"] == "rate_limit_exceeded"
        # ... a regular one waits for the first to finish, then is routed.
        waiting = asyncio.create_task(envoy.send_request(chat_body("third")))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await envoy.finish(busy)
        call, routed = await asyncio.wait_for(waiting, 5)
        assert routed.immediate is None and routed.header
        await envoy.finish(call)


async def test_closed_stream_releases_lease_and_ticket(epp: RunningEpp, envoy: Envoy) -> None:
    call, _ = await envoy.send_request(chat_body("left early"))
    assert in_flight(epp) == 1
    call.cancel()  # Envoy resets the stream: the client went away mid-response
    await eventually(lambda: in_flight(epp) == 0 and epp.gateway.flow.outstanding(MODEL) == 0)


async def test_stream_closed_after_the_request_phase_releases(
    epp: RunningEpp, envoy: Envoy
) -> None:
    call, _ = await envoy.send_request(chat_body("no response processing"))
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    await eventually(lambda: in_flight(epp) == 0 and epp.gateway.flow.outstanding(MODEL) == 0)


async def test_request_without_body_goes_to_the_least_loaded(epp: RunningEpp, envoy: Envoy) -> None:
    busy, first = await envoy.send_request(chat_body("busy"))
    call, routed = await envoy.send_request(None, path="/v1/models")
    assert routed.answers[0].HasField("request_headers")
    assert routed.header != first.header
    await envoy.finish(call)
    await envoy.finish(busy)
    await eventually(lambda: in_flight(epp) == 0)


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"{not json", 400), (orjson.dumps({"model": "nope", "messages": [{"role": "user"}]}), 404)],
)
async def test_bad_requests_are_answered_by_envoy(
    epp: RunningEpp, envoy: Envoy, body: bytes, status: int
) -> None:
    _, routed = await envoy.send_request(body)
    reply = routed.immediate
    assert reply is not None and reply.status.code == status
    assert "error" in orjson.loads(reply.body)
    assert in_flight(epp) == 0


async def test_client_cannot_choose_the_destination(envoy: Envoy) -> None:
    call, routed = await envoy.send_request(chat_body("hi"), headers={DEST: "169.254.169.254:80"})
    assert routed.header != "169.254.169.254:80"
    await envoy.finish(call)


async def test_health_services_and_metrics(epp: RunningEpp, envoy: Envoy) -> None:
    target = f"127.0.0.1:{epp.health_port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", EXT_PROC_SERVICE, ""):
            async with asyncio.timeout(5):
                while True:  # readiness is set by a task right after start-up
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    await asyncio.sleep(0.01)
    call, _ = await envoy.send_request(chat_body("count me"))
    await envoy.finish(call)
    async with httpx.AsyncClient() as client:
        resp = await client.get(f"http://127.0.0.1:{epp.metrics_port}/metrics")
    assert resp.status_code == 200
    assert 'prefixgate_extproc_decisions_total{outcome="routed"} 1.0' in resp.text
    assert "prefixgate_requests_total" in resp.text


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
