from __future__ import annotations

import threading
from typing import Any

import httpx
import orjson

from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream
from tests.gateways import MODEL, Parses, gateway_config


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


LARGE = orjson.dumps(_chat("x y " * 300_000))


async def test_a_large_body_is_parsed_and_hashed_in_the_body_parsers_process(
    parses: Parses,
) -> None:
    loop_thread = threading.current_thread()  # the in-process gateway shares this loop
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "offloadBodyBytes": 4096})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            small = await http.post("/v1/chat/completions", json=_chat("hello"))
            # Over a MiB: joined in a thread, parsed in the pool, written upstream in slices.
            large = await http.post("/v1/chat/completions", content=LARGE)
            parser = gw.gateway.proxy.preparer.parser
            assert parser is not None and parser.digested == 1, "the large body, in the pool"
    assert (small.status_code, large.status_code) == (200, 200)
    assert parses == [(small_size := parses[0][0], loop_thread)] and small_size < 4096
    assert echo.bodies[-1] == LARGE, "forwarded unchanged"


async def test_without_parser_processes_a_large_body_is_parsed_in_a_thread(
    parses: Parses,
) -> None:
    async with echo_upstream() as echo:
        server = {"port": 0, "offloadBodyBytes": 4096, "offloadProcesses": 0}
        config = gateway_config([echo.url], server=server)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            large = await http.post("/v1/chat/completions", json=_chat("x" * 8192))
            assert gw.gateway.proxy.preparer.parser is None
    assert large.status_code == 200
    assert parses.threads and parses.threads[0] is not threading.current_thread()


async def test_a_clients_kv_transfer_params_never_reach_a_replica() -> None:
    """They steer a replica's KV connector (which host it pulls from): the gateway's to set."""
    steer = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}
    small = {**_chat("hello"), "kv_transfer_params": steer}
    large = {**_chat("x y " * 300_000), "kv_transfer_params": steer}
    async with echo_upstream() as echo:
        config = gateway_config([echo.url], server={"port": 0, "offloadBodyBytes": 4096})
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            for payload in (small, large):
                answer = await http.post("/v1/chat/completions", content=orjson.dumps(payload))
                assert answer.status_code == 200
            parser = gw.gateway.proxy.preparer.parser
            assert parser is not None and parser.digested == 1, "the large body, in the pool"
    forwarded = [orjson.loads(b) for b in echo.bodies[-2:]]
    assert forwarded == [_chat("hello"), _chat("x y " * 300_000)]
