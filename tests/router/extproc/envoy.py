"""A client playing Envoy's part against the ext_proc endpoint picker, and the tests' helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

from benchmarks.sim.cli import Replica
from router.extproc.server import RunningEpp
from tests.gateways import MODEL, gateway_config

DEST = "x-gateway-destination-endpoint"
MiB = 1024 * 1024
GRPC_DEFAULT_LIMIT = 4 * MiB
MODE = processing_mode_pb2.ProcessingMode


def epp_config(replicas: Sequence[Replica], **overrides: Any) -> Any:
    ext_proc = {
        "port": 0, "healthPort": 0, "metricsPort": 0, "shutdownDrainSeconds": 0,
        **overrides.pop("extProc", {}),
    }
    return gateway_config([r.url for r in replicas], extProc=ext_proc, **overrides)


def chat_body(text: str, **extra: Any) -> bytes:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}
    return orjson.dumps(payload)


def _headers(values: dict[str, str], end_of_stream: bool = False) -> Any:
    items = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=items), end_of_stream=end_of_stream)


def response_headers(status: str) -> Any:
    return _headers({":status": status})


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
    def removed_headers(self) -> list[str]:
        a = self._mutation_answer()
        common = getattr(a, a.WhichOneof("response")).response
        return list(common.header_mutation.remove_headers)

    @property
    def replaced_body(self) -> bytes:
        """BUFFERED: the body Envoy sends in the client's place."""
        a = self._mutation_answer()
        return bytes(a.request_body.response.body_mutation.body)

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
        response_mode: int | None = None,
        trailers: bool = False,
    ) -> tuple[Any, Routed]:
        """Send a request phase as Envoy would and collect the picker's answers to it
        (``response_mode``: the response body's, when not the request body's; ``trailers``:
        the request ends on trailers, so its body does not end the stream)."""
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
            first.protocol_config.response_body_mode = (
                body_mode if response_mode is None else response_mode
            )
        if subset is not None:
            first.metadata_context.CopyFrom(_subset_metadata(subset))
        await call.write(first)
        routed = Routed()
        if body is None:
            routed.answers.append(await call.read())
            return call, routed
        if mode == "buffered":
            routed.answers.append(await call.read())  # headers let through first
            await call.write(_body(body, end_of_stream=not trailers))
            routed.answers.append(await call.read())
            if trailers:
                await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
                routed.answers.append(await call.read())
            return call, routed
        for i in range(0, len(body), chunk):
            part = body[i : i + chunk]
            last = i + chunk >= len(body)
            await call.write(_body(part, end_of_stream=last and not trailers))
        if trailers:
            await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        while True:
            answer = await call.read()
            assert answer is not grpc.aio.EOF, "stream ended before the body came back"
            routed.answers.append(answer)
            if answer.HasField("immediate_response") or answer.HasField("request_trailers"):
                return call, routed
            stream = answer.request_body.response.body_mutation.streamed_response
            if answer.HasField("request_body") and stream.end_of_stream:
                return call, routed

    async def finish(
        self, call: Any, status: str = "200", duplex: bool = True,
        body: bytes = b"data: [DONE]\n\n",
    ) -> None:
        """The response phase: headers, a body chunk with end of stream, then close."""
        await call.write(pb.ProcessingRequest(response_headers=_headers({":status": status})))
        assert (await call.read()).HasField("response_headers")
        done = pb.HttpBody(body=body, end_of_stream=True)
        await call.write(pb.ProcessingRequest(response_body=done))
        answer = await call.read()
        if duplex:
            assert answer.response_body.response.body_mutation.streamed_response.end_of_stream
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


def in_flight(epp: RunningEpp) -> int:
    return sum(s.in_flight for s in epp.gateway.pool)


async def eventually(predicate: Any, seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 (state changed by the server's tasks)
            await asyncio.sleep(0.01)
