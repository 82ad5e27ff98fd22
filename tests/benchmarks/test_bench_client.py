"""The load generator's parsing of streamed answers and its open-loop arrivals."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest

from benchmarks.bench.client import RequestRecord, WorkloadClient, _consume, _Stream
from benchmarks.bench.conversation import new_state
from benchmarks.workloads import Conversation, Step, Workload, build_workload


def _data(event: object) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n"


def test_stream_parsing_times_the_first_content_token_and_keeps_usage() -> None:
    s = _Stream()
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    _consume(s, _data(role_only), 1.0)
    assert s.first is None  # an empty delta is not a token
    _consume(s, _data({"choices": [{"delta": {"content": "hel"}}]}), 2.0)
    _consume(s, b"\n", 2.5)
    _consume(s, _data({"choices": [{"text": "lo"}]}), 3.0)  # completions' shape
    usage = {"prompt_tokens": 9, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    _consume(s, _data({"choices": [], "usage": usage}), 4.0)
    _consume(s, b"data: [DONE]\n", 5.0)
    assert (s.first, s.last, s.chunks, "".join(s.answer)) == (2.0, 3.0, 2, "hello")
    assert s.usage == usage and s.error is None


def test_stream_parsing_catches_a_mid_stream_error() -> None:
    s = _Stream()
    _consume(s, _data({"error": {"message": "boom", "type": "internal_error"}}), 1.0)
    assert s.error == "boom"


def test_open_loop_arrivals_are_seeded_poisson_in_wall_seconds() -> None:
    workload = build_workload("shared-prefix", "small", rate=4.0)
    client = WorkloadClient(["http://127.0.0.1:1"], workload, speed=10.0)
    starts = client._arrivals()
    assert starts == WorkloadClient(["http://x"], workload, speed=10.0)._arrivals()
    assert starts[0] == 0 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Mean gap 1/rate simulated seconds = 1/(rate * speed) wall seconds.
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 40, rel=0.25)
    closed = WorkloadClient(["http://x"], build_workload("shared-prefix", "tiny"), speed=10.0)
    assert set(closed._arrivals()) == {0.0}


async def test_a_stream_cut_after_its_first_token_is_an_error_not_an_answer() -> None:
    # A 200 whose chunked body stops mid-answer (the connection dropped): the first token
    # came, but the answer never completed. It must count as an error, not as answered.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        body = _data({"choices": [{"delta": {"content": "half"}}]}) + b"\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n")
        await writer.drain()
        writer.close()  # no terminating chunk, no [DONE]

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    workload = Workload("one", (Conversation("s", "system", (Step("hi", 4),)),), 1)
    async with server:
        run = await WorkloadClient([f"http://127.0.0.1:{port}"], workload).run()
    (record,) = run.records
    assert record.error is not None and "ClientPayloadError" in record.error
    assert not record.ok and record.ttft is None
    assert run.errors == 1


def test_a_transport_error_after_the_first_token_fails_the_request() -> None:
    conv = Conversation("s", "system", (Step("hi", 4),))
    client = WorkloadClient(["http://127.0.0.1:1"], Workload("one", (conv,), 1))
    state = new_state(client._tok, conv)
    state.add("user", "hi")
    record = RequestRecord("main", 0.0, 200, False, error="ClientPayloadError: cut")
    stream = _Stream(answer=["half"], first=1.0, last=1.0, chunks=1)
    assert client._finish(record, stream, state, state.prompt(), 0.5) is None
    assert not record.ok and record.ttft is None and client._run.errors == 1
