"""The ext_proc picker learns bytes per token like the HTTP gateway: from the answers' usage
when Envoy streams the response bodies through it, else from the replica's /tokenize."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from benchmarks.sim.cli import Replica, start_replicas
from benchmarks.sim.config import SimConfig
from router.core.endpoints import endpoint_id_from_url
from router.extproc.server import RunningEpp, running_epp
from tests.gateways import MODEL, learned_first_tokens
from tests.router.extproc.envoy import (
    MODE,
    Envoy,
    chat_body,
    epp_config,
    eventually,
    in_flight,
    response_headers,
)

WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "tau")


@pytest.fixture
async def dense_replicas() -> AsyncIterator[list[Replica]]:
    """Replicas whose tokenizer covers 9 bytes a token, where the prior says 4."""
    async with start_replicas(2, SimConfig(zero_latency=True, bytes_per_token=9.0)) as reps:
        yield reps


@pytest.fixture
async def dense_epp(dense_replicas: list[Replica]) -> AsyncIterator[RunningEpp]:
    async with running_epp(epp_config(dense_replicas)) as running:
        yield running


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 999)) for _ in range(300))


async def test_usage_in_the_response_bodies_envoy_streams_through_teaches_the_ratio(
    dense_replicas: list[Replica], dense_epp: RunningEpp
) -> None:
    rng, urls = random.Random(1), {endpoint_id_from_url(r.url): r.url for r in dense_replicas}
    density = dense_epp.gateway.sizer.density
    async with (
        grpc.aio.insecure_channel(dense_epp.target) as channel,
        httpx.AsyncClient() as http,
    ):
        envoy = Envoy(channel)
        for i in range(24):
            # Not streamed, streamed with usage and without, as the clients ask; the answer is
            # the replica's own, fetched from where the picker sent it, as Envoy relays it. A
            # stream without usage has the replica count its prompt.
            extra = [{}, {"stream": True, "stream_options": {"include_usage": True}},
                     {"stream": True}][i % 3]
            body = chat_body(_prompt(rng), max_tokens=2, **extra)
            call, routed = await envoy.send_request(body)
            answer = await http.post(
                urls[routed.header] + "/v1/chat/completions", content=body,
                headers={"content-type": "application/json"},
            )
            await envoy.finish(call, body=answer.content)
            await dense_epp.gateway.token_counts.settle()
    # 16 answers carried usage; the streams without it were counted until 16 samples.
    assert density.samples(MODEL) > 16
    assert density.ratio(MODEL) == pytest.approx(9.0, rel=0.05)
    assert dense_epp.gateway.token_counts.wants(MODEL) is False


async def test_an_answer_that_ends_on_trailers_hands_over_its_usage(
    dense_replicas: list[Replica], dense_epp: RunningEpp
) -> None:
    urls = {endpoint_id_from_url(r.url): r.url for r in dense_replicas}
    async with (
        grpc.aio.insecure_channel(dense_epp.target) as channel,
        httpx.AsyncClient() as http,
    ):
        body = chat_body(_prompt(random.Random(3)), max_tokens=2)
        call, routed = await Envoy(channel).send_request(body)
        answer = await http.post(
            urls[routed.header] + "/v1/chat/completions", content=body,
            headers={"content-type": "application/json"},
        )
        await call.write(pb.ProcessingRequest(response_headers=response_headers("200")))
        await call.read()
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer.content)))
        await call.read()
        await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        await call.read()
        await call.done_writing()
    assert dense_epp.gateway.sizer.density.samples(MODEL) == 1


async def test_without_response_bodies_the_replica_counts_the_prompts(
    dense_epp: RunningEpp,
) -> None:
    rng = random.Random(2)
    gateway = dense_epp.gateway
    async with grpc.aio.insecure_channel(dense_epp.target) as channel:
        envoy = Envoy(channel)
        for _ in range(40):  # 8 samples teach it; a count in flight skips a prompt
            body = chat_body(_prompt(rng), max_tokens=2)
            call, _ = await envoy.send_request(body, response_mode=MODE.NONE)
            await call.done_writing()  # the response passes Envoy without the picker
            assert await call.read() is grpc.aio.EOF
            await gateway.token_counts.settle()
            if gateway.sizer.density.samples(MODEL) >= 8:
                break
    assert gateway.sizer.density.ratio(MODEL) == pytest.approx(9.0, rel=0.05)
    await eventually(lambda: in_flight(dense_epp) == 0)


async def _answer_in_chunks(call: Any, *chunks: bytes) -> None:
    await call.write(pb.ProcessingRequest(response_headers=response_headers("200")))
    await call.read()
    for chunk in chunks:
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
        await call.read()


async def _end(call: Any) -> None:
    end = pb.HttpBody(body=b"", end_of_stream=True)
    await call.write(pb.ProcessingRequest(response_body=end))
    await call.read()
    await call.done_writing()


async def test_a_streams_first_token_is_timed_at_its_first_body_chunk_not_its_headers(
    dense_epp: RunningEpp,
) -> None:
    """A streaming vLLM sends its headers at once; the picker learns the time to first token
    from the first body chunk Envoy streams through it, and from headers alone nothing."""
    learned = learned_first_tokens(dense_epp.gateway.calibrator)
    async with grpc.aio.insecure_channel(dense_epp.target) as channel:
        envoy = Envoy(channel)
        body = chat_body("hello", max_tokens=2, stream=True)
        call, _ = await envoy.send_request(body)
        await _answer_in_chunks(call)
        assert learned == []
        await _answer_in_chunks(call, b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        assert len(learned) == 1
        await _end(call)
        # Headers alone (no response bodies through the picker) time nothing, nor do they
        # when Envoy does not say which body modes it uses (the bodies may never come).
        call, _ = await envoy.send_request(body, response_mode=MODE.NONE)
        await _answer_in_chunks(call)
        await call.done_writing()
        call, _ = await envoy.send_request(body, announce_mode=False)
        await _answer_in_chunks(call, b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        await _end(call)
    assert len(learned) == 1
    await eventually(lambda: in_flight(dense_epp) == 0)


async def test_a_responses_streams_first_token_is_past_its_opening_events(
    dense_epp: RunningEpp,
) -> None:
    learned = learned_first_tokens(dense_epp.gateway.calibrator)
    opening = b"".join(
        b'event: %s\ndata: {"type":"%s"}\n\n' % (name, name)
        for name in (b"response.created", b"response.in_progress")
    )
    delta = b'event: response.output_text.delta\ndata: {"delta":"hi"}\n\n'
    payload = {"model": MODEL, "input": "hello", "stream": True, "max_output_tokens": 2}
    async with grpc.aio.insecure_channel(dense_epp.target) as channel:
        call, _ = await Envoy(channel).send_request(orjson.dumps(payload), path="/v1/responses")
        await _answer_in_chunks(call, opening)
        assert learned == []
        await _answer_in_chunks(call, delta)
        assert len(learned) == 1
        await _end(call)
    await eventually(lambda: in_flight(dense_epp) == 0)


async def test_a_failure_reading_an_answer_does_not_cut_it(
    dense_epp: RunningEpp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is the replica's: should the picker's own reading of it fail (here, learning
    from its first token), Envoy still gets every chunk back, and the request is released."""

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in the learner")

    monkeypatch.setattr(dense_epp.gateway.calibrator, "observe", broken)
    token = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    async with grpc.aio.insecure_channel(dense_epp.target) as channel:
        call, _ = await Envoy(channel).send_request(chat_body("hello", max_tokens=2, stream=True))
        await call.write(pb.ProcessingRequest(response_headers=response_headers("200")))
        assert (await call.read()).HasField("response_headers")
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=token)))
        answer = await call.read()
        assert answer.response_body.response.body_mutation.streamed_response.body == token
        done = pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)
        await call.write(pb.ProcessingRequest(response_body=done))
        last = (await call.read()).response_body.response.body_mutation.streamed_response
        assert last.body == done.body and last.end_of_stream
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    await eventually(lambda: in_flight(dense_epp) == 0)
