from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from router.protocol.parsing import Api, ParsedRequest
from router.scheduling import routing
from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream
from tests.gateways import MODEL, gateway_config


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def test_a_large_body_is_parsed_and_hashed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed_in: list[tuple[int, threading.Thread]] = []
    hashed_in: list[threading.Thread] = []
    parse, hash_blocks = routing.parse_request, routing.hash_blocks

    def parse_spy(api: Api, body: bytes) -> ParsedRequest:
        parsed_in.append((len(body), threading.current_thread()))
        return parse(api, body)

    def hash_spy(data: bytes, *args: Any) -> list[int]:
        hashed_in.append(threading.current_thread())
        return hash_blocks(data, *args)

    monkeypatch.setattr(routing, "parse_request", parse_spy)
    monkeypatch.setattr(routing, "hash_blocks", hash_spy)
    loop_thread = threading.current_thread()  # the in-process gateway shares this loop
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "offloadBodyBytes": 4096})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            small = await http.post("/v1/chat/completions", json=_chat("hello"))
            large = await http.post("/v1/chat/completions", json=_chat("x" * 8192))
    assert (small.status_code, large.status_code) == (200, 200)
    [(small_size, small_thread), (large_size, large_thread)] = parsed_in
    assert small_size < 4096 <= large_size
    assert small_thread is loop_thread, "a small body is cheaper parsed in place"
    assert large_thread is not loop_thread
    assert hashed_in == [small_thread, large_thread], "hashed where it was parsed"
