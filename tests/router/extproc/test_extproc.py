"""The ext_proc endpoint picker over real loopback gRPC, with a client playing Envoy's part:
routing."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import httpx
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.sim.cli import Replica
from router.extproc.messages import subset_hint
from router.extproc.server import EXT_PROC_SERVICE, RunningEpp, running_epp
from tests.gateways import MODEL, Parses
from tests.router.extproc.envoy import (
    DEST,
    GRPC_DEFAULT_LIMIT,
    Envoy,
    MiB,
    chat_body,
    epp_config,
    eventually,
    in_flight,
    response_headers,
)


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


async def test_a_large_body_is_parsed_and_hashed_in_the_body_parsers_process(
    two_replicas: list[Replica], parses: Parses
) -> None:
    loop_thread = threading.current_thread()  # the in-process picker shares this loop
    config = epp_config(two_replicas, server={"offloadBodyBytes": 4096})
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        for body in (chat_body("hello"), chat_body("x y " * 100_000)):
            call, routed = await envoy.send_request(body)
            assert routed.header in {s.endpoint.id for s in epp.gateway.pool}
            await envoy.finish(call)
        parser = epp.gateway.proxy.preparer.parser
        assert parser is not None and parser.digested == 1, "the large body, in the pool"
    assert len(parses) == 1 and parses[0][0] < 4096 and parses[0][1] is loop_thread


async def test_without_parser_processes_a_large_body_is_parsed_in_a_thread(
    two_replicas: list[Replica], parses: Parses
) -> None:
    config = epp_config(two_replicas, server={"offloadBodyBytes": 4096, "offloadProcesses": 0})
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        call, routed = await envoy.send_request(chat_body("x" * 8192), mode="buffered")
        assert routed.header in {s.endpoint.id for s in epp.gateway.pool}
        await envoy.finish(call, duplex=False)
        assert epp.gateway.proxy.preparer.parser is None
    assert len(parses.threads) == 1 and parses.threads[0] is not threading.current_thread()


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


@pytest.mark.parametrize("body", [chat_body("hi"), None], ids=["routed", "without a body"])
async def test_a_request_served_by_a_fallback_is_counted_there(
    two_replicas: list[Replica], body: bytes | None
) -> None:
    """The data plane reports the endpoint that served the request (envoy.lb,
    x-gateway-destination-endpoint-served): the pick may have been unreachable."""
    config = epp_config(two_replicas, extProc={"fallbackEndpoints": 1})
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        call, routed = await envoy.send_request(body, path="/v1/chat/completions")
        _, fallback = routed.header.split(",")
        served = struct_pb2.Struct()
        served.update({"x-gateway-destination-endpoint-served": fallback})
        message = pb.ProcessingRequest(response_headers=response_headers("200"))
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
        await call.write(message)
        answer = await call.read()
        set_headers = answer.response_headers.response.header_mutation.set_headers
        assert {h.header.key: h.header.raw_value.decode() for h in set_headers}[DEST] == fallback
        assert [s.endpoint.id for s in epp.gateway.pool if s.in_flight] == [fallback]
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
        await call.read()
        await call.done_writing()
    assert in_flight(epp) == 0


@pytest.mark.parametrize("body", [chat_body("hi"), None], ids=["routed", "without a body"])
async def test_a_request_the_data_plane_served_off_the_list_is_counted_there(
    epp: RunningEpp, envoy: Envoy, body: bytes | None
) -> None:
    """With no fallback listed, the gateway may still serve the request elsewhere (its own
    fallback policy when the pick is gone, say): the endpoint it reports as served wins."""
    call, routed = await envoy.send_request(body)
    other = next(s.endpoint.id for s in epp.gateway.pool if s.endpoint.id != routed.header)
    served = struct_pb2.Struct()
    served.update({"x-gateway-destination-endpoint-served": other})
    message = pb.ProcessingRequest(response_headers=response_headers("200"))
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    await call.write(message)
    answer = await call.read()
    set_headers = answer.response_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in set_headers}[DEST] == other
    assert [s.endpoint.id for s in epp.gateway.pool if s.in_flight] == [other]
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
    await call.read()
    await call.done_writing()
    await eventually(lambda: in_flight(epp) == 0)


async def test_a_served_endpoint_outside_the_pool_is_not_followed(
    epp: RunningEpp, envoy: Envoy
) -> None:
    call, routed = await envoy.send_request(chat_body("hi"))
    served = struct_pb2.Struct()
    served.update({"x-gateway-destination-endpoint-served": "10.255.0.1:8000"})
    message = pb.ProcessingRequest(response_headers=response_headers("200"))
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    await call.write(message)
    answer = await call.read()
    set_headers = answer.response_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in set_headers}[DEST] == routed.header
    assert [s.endpoint.id for s in epp.gateway.pool if s.in_flight] == [routed.header]
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
    await call.read()
    await call.done_writing()
    await eventually(lambda: in_flight(epp) == 0)


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
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"  # llm-d's name
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


async def test_a_stream_reset_while_queued_leaves_the_queue(two_replicas: list[Replica]) -> None:
    """The client goes away while its request waits in flow control: Envoy resets the stream,
    and the request must neither stay queued nor be routed later."""
    flow = {"saturationDetector": {"inFlightThreshold": 1}, "defaultRequestTTL": 30}
    config = epp_config(two_replicas[:1], flowControl=flow)
    async with running_epp(config) as epp, grpc.aio.insecure_channel(epp.target) as channel:
        envoy = Envoy(channel)
        busy, _ = await envoy.send_request(chat_body("first"))
        waiting = asyncio.create_task(envoy.send_request(chat_body("queued")))
        await eventually(lambda: epp.gateway.flow.queued == 1)
        waiting.cancel()  # the call's cancellation resets the stream
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await eventually(lambda: epp.gateway.flow.queued == 0)
        await envoy.finish(busy)
        await eventually(lambda: in_flight(epp) == 0 and epp.gateway.flow.outstanding(MODEL) == 0)
        routed = epp.gateway.metrics.registry.get_sample_value(
            "prefixgate_extproc_decisions_total", {"outcome": "routed"}
        )
        assert routed == 1


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


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
async def test_a_request_that_ends_on_trailers_is_routed_once(
    epp: RunningEpp, envoy: Envoy, mode: str
) -> None:
    """Envoy sends a buffered body with end_of_stream false when trailers follow: the body
    message is still the whole body, and the answer to it carries the destination (a trailers
    answer cannot set request headers)."""
    body = chat_body("ends on trailers")
    call, routed = await envoy.send_request(body, mode=mode, trailers=True)
    kinds = [a.WhichOneof("response") for a in routed.answers]
    assert kinds[-1] == "request_trailers"
    assert kinds.count("request_trailers") == 1
    assert routed.header in {s.endpoint.id for s in epp.gateway.pool}
    if mode == "duplex":
        assert routed.body == body
    else:
        assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert in_flight(epp) == 1
    await envoy.finish(call, duplex=mode == "duplex")
    await eventually(lambda: in_flight(epp) == 0 and epp.gateway.flow.outstanding(MODEL) == 0)


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
async def test_a_clients_kv_transfer_params_are_dropped_from_the_body(
    envoy: Envoy, mode: str
) -> None:
    plain = chat_body("steered", max_tokens=2)
    steered = chat_body("steered", max_tokens=2, kv_transfer_params={"remote_host": "10.0.0.1"})
    call, routed = await envoy.send_request(steered, mode=mode)
    if mode == "duplex":
        assert orjson.loads(routed.body) == orjson.loads(plain)
        assert "content-length" in routed.removed_headers
    else:
        assert orjson.loads(routed.replaced_body) == orjson.loads(plain)
        assert routed.set_header("content-length") == str(len(routed.replaced_body))
    await envoy.finish(call, duplex=mode == "duplex")


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
async def test_a_clients_sidecar_routing_headers_are_stripped(envoy: Envoy, mode: str) -> None:
    """llm-d's routing sidecar on the decode pod reads these: each names a host it would reach."""
    hostile = {
        "x-encoder-hosts-ports": "169.254.169.254:80",
        "x-data-parallel-host-port": "10.0.0.9:8001",
        "x-kv-cache-source-host-port": "169.254.169.254:80",
        "x-llm-d-prefiller-host-port": "169.254.169.254:80",
        "x-prefiller-host-port": "169.254.169.254:80",
        "x-gateway-destination-endpoint-served": "10.0.0.9:8000",
        "x-gateway-destination-endpoint-fallback": "10.0.0.9:8000",
    }
    call, routed = await envoy.send_request(chat_body("hi"), mode=mode, headers=hostile)
    removed = set(routed.removed_headers)
    if mode == "buffered":  # the answer to the headers strips them too
        removed |= set(routed.answers[0].request_headers.response.header_mutation.remove_headers)
    assert set(hostile) <= removed
    await envoy.finish(call, duplex=mode == "duplex")


def test_a_subset_hints_entries_may_be_comma_separated_lists() -> None:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000,10.0.0.2:8000"]})
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    assert subset_hint(metadata) == {"10.0.0.1:8000", "10.0.0.2:8000"}


async def test_an_answer_the_pick_served_with_fallbacks_listed_is_remembered_there(
    two_replicas: list[Replica],
) -> None:
    """With a fallback list the picker cannot know who answers, until the data plane says:
    then a Responses answer is remembered where it is stored."""
    config = epp_config(two_replicas, extProc={"fallbackEndpoints": 1})
    urls = {f"{r.host}:{r.port}": r.url for r in two_replicas}
    body = orjson.dumps({"model": MODEL, "input": "remember me", "max_output_tokens": 4})
    async with (
        running_epp(config) as epp,
        grpc.aio.insecure_channel(epp.target) as channel,
        httpx.AsyncClient() as http,
    ):
        call, routed = await Envoy(channel).send_request(body, path="/v1/responses")
        pick = routed.header.split(",")[0]
        answer = await http.post(urls[pick] + "/v1/responses", content=body,
                                 headers={"content-type": "application/json"})
        served = struct_pb2.Struct()
        served.update({"x-gateway-destination-endpoint-served": pick})
        message = pb.ProcessingRequest(response_headers=response_headers("200"))
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
        await call.write(message)
        await call.read()
        last = pb.HttpBody(body=answer.content, end_of_stream=True)
        await call.write(pb.ProcessingRequest(response_body=last))
        await call.read()
        await call.done_writing()
        await eventually(lambda: in_flight(epp) == 0)
    assert epp.gateway.stores.responses.local(answer.json()["id"]) == pick


async def test_requests_the_picker_refuses_are_counted_by_status(
    epp: RunningEpp, envoy: Envoy
) -> None:
    """prefixgate_requests counts every answered request, by status, endpoint 'none' when the
    gateway refused it (the dashboard's requests by status): the picker's refusals too."""
    _, routed = await envoy.send_request(b"{not json")
    assert routed.immediate is not None and routed.immediate.status.code == 400
    await eventually(lambda: refused(epp, "400") == 1, 5)


def refused(epp: RunningEpp, status: str) -> float:
    return sum(
        sample.value
        for family in epp.gateway.metrics.registry.collect()
        if family.name == "prefixgate_requests"
        for sample in family.samples
        if sample.name == "prefixgate_requests_total"
        and sample.labels["endpoint"] == "none"
        and sample.labels["status"] == status
    )


async def test_a_clients_request_id_names_the_request_only_when_plain(
    envoy: Envoy, caplog: pytest.LogCaptureFixture
) -> None:
    """As at the HTTP gateway: a client's x-request-id names the request in the logs only when
    it is a short plain token."""
    caplog.set_level(logging.DEBUG, logger="prefixgate.decision")
    for request_id in ("req-1", "x" * 300):
        call, _ = await envoy.send_request(chat_body("hi"), headers={"x-request-id": request_id})
        await envoy.finish(call)
    logged = [r.getMessage() for r in caplog.records if r.name == "prefixgate.decision"]
    assert any(m.startswith("request req-1:") for m in logged)
    assert not any("x" * 300 in m for m in logged)
