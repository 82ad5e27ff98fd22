"""Structured logs: JSON lines, one access line per request, never a key, never blocking."""

from __future__ import annotations

import asyncio
import io
import logging
import queue
from collections.abc import Iterator

import httpx
import orjson
import pytest

from router.api.logs import (
    ACCESS_LOGGER,
    DroppingQueueHandler,
    JsonFormatter,
    TextFormatter,
    configure_logging,
)
from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream
from tests.gateways import MODEL, gateway_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
CLIENT_KEY = "sk-client-key-abcdef"
UPSTREAM_KEY = "sk-upstream-key-123456"


def record(msg: str = "request", **fields: object) -> logging.LogRecord:
    rec = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, msg, None, None)
    rec.fields = fields
    return rec


def test_json_lines_carry_the_fields() -> None:
    line = JsonFormatter().format(record(request_id="r1", status=200, ttfb_ms=1.5, endpoint=None))
    data = orjson.loads(line)
    assert data["logger"] == ACCESS_LOGGER and data["level"] == "info"
    assert (data["request_id"], data["status"], data["ttfb_ms"]) == ("r1", 200, 1.5)
    assert data["ts"].endswith("Z") and "\n" not in line


def test_text_lines_are_logfmt_and_quote_what_needs_it() -> None:
    line = TextFormatter().format(record(a="plain", b="two words", c=None, d='q"uote', e="x\ny"))
    assert line.endswith('a=plain b="two words" c=- d="q\\"uote" e="x\\ny"')


def test_a_full_log_queue_drops_instead_of_blocking() -> None:
    handler = DroppingQueueHandler(queue.Queue(2))
    for _ in range(5):
        handler.emit(record())
    assert handler.dropped == 3


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The root logger through configure_logging into a buffer, restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("httpx").level)
    stream = io.StringIO()
    stop = configure_logging("debug", "json", stream)
    try:
        yield stream
    finally:
        stop()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.getLogger("httpx").setLevel(saved[2])


async def test_access_log_one_json_line_per_request_and_no_key(json_log: io.StringIO) -> None:
    async with echo_upstream() as echo:
        config = gateway_config(
            [echo.url],
            pool={"endpoints": [{"url": echo.url, "apiKey": UPSTREAM_KEY}]},
            auth={"enabled": True, "apiKeys": [{"key": CLIENT_KEY, "tenant": "team-a"}]},
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            good = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": "req-1"}
            ok = await http.post("/v1/chat/completions", json=CHAT, headers=good)
            bad = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"x-api-key": CLIENT_KEY + "x"}
            )
            invalid = await http.post("/v1/completions", content=b"{", headers=good)
            for _ in range(250):  # the writer thread
                if json_log.getvalue().count(f'"logger":"{ACCESS_LOGGER}"') >= 3:
                    break
                await asyncio.sleep(0.02)
    assert (ok.status_code, bad.status_code, invalid.status_code) == (200, 401, 400)
    text = json_log.getvalue()
    lines = [orjson.loads(line) for line in text.splitlines()]
    assert lines, "every line is one JSON object"
    access = [line for line in lines if line["logger"] == ACCESS_LOGGER]
    assert [(a["status"], a["tenant"], a["api"]) for a in access] == [
        (200, "team-a", "chat"), (401, None, "chat"), (400, "team-a", "completions")
    ]
    first = access[0]
    assert first["request_id"] == "req-1" and first["endpoint"] == echo.url[len("http://"):]
    assert first["attempts"] == 1 and first["ttfb_ms"] <= first["duration_ms"]
    assert CLIENT_KEY not in text and UPSTREAM_KEY not in text
    assert echo.received[0]["authorization"] == f"Bearer {UPSTREAM_KEY}"


async def test_access_log_records_disconnects(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with echo_upstream() as echo:
        echo.stall_streams = True
        async with (
            running_gateway(gateway_config([echo.url])) as gw,
            httpx.AsyncClient(base_url=gw.url) as http,
        ):
            async with http.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
                await anext(resp.aiter_bytes())
            for _ in range(100):
                if gw.gateway.proxy.active == 0:
                    break
                await asyncio.sleep(0.02)
    fields = [getattr(r, "fields", None) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(fields) == 1 and fields[0] is not None
    assert fields[0]["outcome"] == "client_disconnect" and fields[0]["status"] == 200
