"""A replica that answers every completion at once with bytes prepared at start: the cheapest
stand-in for vLLM, for measuring a router on a machine whose cores it shares with the replica.

The simulator's zero-latency mode still tokenizes, hashes and books every prompt in its KV cache
(about 0.2 ms of CPU a request, as much as a gateway): on two cores, it and the load tool leave
little for a second gateway worker. This one parses HTTP with httptools and writes a prepared
answer: the chat and completions routes (streamed when the body asks, with a usage in the last
event), and what the gateway's monitor reads: /health, /v1/models and /metrics with vLLM's
names for an idle replica.

    python -m benchmarks.static_replica --port 8001 [--model sim-model] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import httptools
import orjson
import uvloop

HOST = "127.0.0.1"


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _usage(tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": 100, "completion_tokens": tokens, "total_tokens": 100 + tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


class Answers:
    """Every answer, rendered once."""

    def __init__(self, model: str, tokens: int) -> None:
        json, sse = b"application/json", b"text/event-stream"
        self.health = _response(b"200 OK", json, b"{}")
        self.not_found = _response(b"404 Not Found", json, b'{"error":"not found"}')
        self.models = _response(b"200 OK", json, orjson.dumps(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "static"}]}
        ))
        labels = f'model_name="{model}"'
        metrics = "".join(
            f"vllm:{name}{{{labels}}} 0.0\n"
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ) + f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="100000",{labels}}} 1.0\n'
        self.metrics = _response(b"200 OK", b"text/plain; version=0.0.4", metrics.encode())
        self.chat = _response(b"200 OK", json, orjson.dumps({
            "id": "static", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "ok " * tokens}}],
            "usage": _usage(tokens),
        }))
        self.completion = _response(b"200 OK", json, orjson.dumps({
            "id": "static", "object": "text_completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "length", "text": "ok " * tokens}],
            "usage": _usage(tokens),
        }))
        self.chat_stream = _response(b"200 OK", sse, self._events(model, tokens, chat=True))
        self.completion_stream = _response(b"200 OK", sse, self._events(model, tokens, chat=False))

    @staticmethod
    def _events(model: str, tokens: int, chat: bool) -> bytes:
        kind = "chat.completion.chunk" if chat else "text_completion"
        events: list[dict[str, object]] = []
        piece: dict[str, object] = {"delta": {"content": "ok "}} if chat else {"text": "ok "}
        for _ in range(tokens):
            choice = {"index": 0, **piece}
            events.append({"id": "static", "object": kind, "model": model, "choices": [choice]})
        events.append({"id": "static", "object": kind, "model": model, "choices": [],
                       "usage": _usage(tokens)})
        return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    def reply(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"POST":
            stream = b'"stream":true' in body.replace(b" ", b"")
            if path == b"/v1/chat/completions":
                return self.chat_stream if stream else self.chat
            if path == b"/v1/completions":
                return self.completion_stream if stream else self.completion
        elif path == b"/health":
            return self.health
        elif path == b"/v1/models":
            return self.models
        elif path == b"/metrics":
            return self.metrics
        return self.not_found


class Connection(asyncio.Protocol):
    """One client connection: requests parsed as they come, each answered when complete."""

    def __init__(self, answers: Answers) -> None:
        self._answers = answers
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        path = self._url.partition(b"?")[0]
        answer = self._answers.reply(self._parser.get_method(), path, b"".join(self._body))
        self._url, self._body = b"", []
        self._transport.write(answer)
        if not self._parser.should_keep_alive():
            self._transport.close()


async def start(port: int, model: str = "sim-model", tokens: int = 8) -> asyncio.Server:
    """The replica, listening on loopback ``port`` (0: any free one) until closed."""
    loop = asyncio.get_running_loop()
    answers = Answers(model, tokens)
    return await loop.create_server(lambda: Connection(answers), HOST, port, reuse_address=True)


async def serve(port: int, model: str, tokens: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with await start(port, model, tokens):
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--tokens", type=int, default=8, help="tokens in every answer")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.port, args.model, args.tokens))


if __name__ == "__main__":
    main()
