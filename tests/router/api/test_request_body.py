"""The body parser's processes give routing exactly what parsing in place gives."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.api import request_body
from router.api.request_body import BodyParser, BodyPreparer
from router.app import build_gateway
from router.config.model import PrefixIndexConfig, parse_config
from router.core.errors import BadRequestError
from router.protocol import parsing
from router.protocol.parsing import Api, digest_body, parse_request, prompt_hashes
from router.scheduling.routing import Prepared, Router
from tests.gateways import MODEL, Parses, gateway_config

BODIES: list[tuple[Api, dict[str, Any]]] = [
    ("chat", {
        "model": "m", "stream": True, "tools": [{"type": "function", "name": "f"}],
        "messages": [
            {"role": "system", "content": "be brief " * 300},
            {"role": "user", "content": "question é " * 200},
            {"role": "assistant", "content": "answer " * 100},
            {"role": "user", "content": [{"type": "text", "text": "more " * 100}]},
        ],
    }),
    ("completions", {"model": "m", "prompt": "p" * 5000}),
    ("messages", {
        "model": "m", "max_tokens": 4, "metadata": {"user_id": "u1"},
        "messages": [{"role": "user", "content": "hi " * 2000}],
    }),
    ("responses", {
        "model": "m", "input": "in " * 2000, "previous_response_id": "resp_1",
        "prompt_cache_key": "k",
    }),
]


@pytest.fixture
async def parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where bodies are spilled
    parser = BodyParser(1)
    try:
        yield parser
    finally:
        await parser.aclose()
    assert not os.listdir(tmp_path), "every spilled body removed"


@pytest.mark.parametrize(("api", "payload"), BODIES, ids=[api for api, _ in BODIES])
async def test_a_body_parsed_in_the_pool_routes_as_one_parsed_in_place(
    parser: BodyParser, api: Api, payload: dict[str, Any]
) -> None:
    body = orjson.dumps(payload)
    digest = await parser.digest(api, body, 64, 1000)
    assert parser.digested == 1
    inline = parse_request(api, body)
    size, hashes = prompt_hashes(inline, 64, 1000)
    assert digest == digest_body(api, body, 64, 1000)
    assert (digest.prompt_bytes, digest.block_hashes) == (size, hashes) and len(hashes) > 10
    parsed = digest.parsed(api, body)
    assert parsed.decoded is None and parsed.prompt is None, "nothing decoded in the gateway"
    for field in ("model", "stream", "session_hint", "previous_response_id", "answer_span"):
        assert getattr(parsed, field) == getattr(inline, field), field
    # A path that reads the payload still gets it, decoded on demand (never the prompt: below).
    assert parsed.payload == inline.payload


async def test_a_bad_body_is_refused_by_the_pool_as_in_place(parser: BodyParser) -> None:
    with pytest.raises(BadRequestError) as in_pool:
        await parser.digest("chat", b'{"model": "m", "messages": 3}', 64, 1000)
    assert in_pool.value.param == "messages" and in_pool.value.status_code == 400


async def test_the_pool_starts_on_first_use_and_stops_on_close() -> None:
    parser = BodyParser(1)
    assert parser._pool is None, "no process for a gateway that never sees a large body"
    await parser.digest("completions", b'{"model": "m", "prompt": "x"}', 64, 10)
    assert parser._pool is not None
    pool = await parser._pool
    await parser.aclose()
    assert parser._pool is None
    with pytest.raises(RuntimeError):
        pool.submit(int)


async def test_a_pool_that_breaks_hands_the_body_to_a_thread_and_is_started_anew(
    parser: BodyParser,
) -> None:
    body = orjson.dumps({"model": "m", "prompt": "p" * 300})
    first = await parser.digest("completions", body, 64, 10)
    assert parser._pool is not None
    broken = await parser._pool
    for process in list(broken._processes.values()):  # as if killed for its memory
        process.kill()
        process.join()
    again = await parser.digest("completions", body, 64, 10)
    assert again == first and parser.digested == 1, "the second one, in a thread"
    assert parser._pool is None
    assert await parser.digest("completions", body, 64, 10) == first
    assert parser.digested == 2 and parser._pool is not None


async def test_no_room_for_the_file_keeps_the_pool_and_parses_in_a_thread(
    parser: BodyParser, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = orjson.dumps({"model": "m", "prompt": "p" * 300})
    first = await parser.digest("completions", body, 64, 10)
    pool = parser._pool

    def full(fd: int, data: bytes) -> None:
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(request_body, "_spill", full)
    assert await parser.digest("completions", body, 64, 10) == first
    assert parser.digested == 1 and parser._pool is pool, "the pool is not at fault"


async def test_a_request_cancelled_while_its_body_is_spilled_leaves_no_file(
    parser: BodyParser, monkeypatch: pytest.MonkeyPatch
) -> None:
    writing, release = threading.Event(), threading.Event()
    spill = request_body._spill

    def slow(fd: int, data: bytes) -> None:
        writing.set()
        release.wait(30)
        spill(fd, data)

    monkeypatch.setattr(request_body, "_spill", slow)
    task = asyncio.create_task(parser.digest("completions", b'{"model": "m"}', 64, 10))
    await asyncio.to_thread(writing.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()  # the thread finishes writing into the file already removed
    # (the fixture checks that the temporary directory is empty)


async def test_after_close_a_large_body_is_parsed_in_a_thread_and_no_pool_starts() -> None:
    parser = BodyParser(1)
    await parser.aclose()
    body = orjson.dumps({"model": "m", "prompt": "p" * 300})
    assert await parser.digest("completions", body, 64, 10) == digest_body(
        "completions", body, 64, 10
    )
    assert parser._pool is None and parser.digested == 0


def test_a_parser_needs_a_process() -> None:
    with pytest.raises(ValueError):
        BodyParser(0)


def _router(offload_bytes: int) -> tuple[Any, Router]:
    endpoint = {"url": "http://127.0.0.1:1", "models": [MODEL]}
    server = {"offloadBodyBytes": offload_bytes}
    config = gateway_config([], pool={"endpoints": [endpoint]}, server=server)
    return config, build_gateway(config).router


async def test_a_body_parsed_in_the_pool_is_never_rendered_again_on_the_loop(
    parser: BodyParser, parses: Parses
) -> None:
    config, router = _router(0)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 500}]})
    prepared = await BodyPreparer(config, router, parser).prepare(
        "chat", body, decodes_payload=False
    )
    assert parser.digested == 1
    parsed = prepared.parsed
    # Routing reads the prompt first (to hash it) when it is not handed the Prepared: a
    # clear error then, not the whole body parsed again on the loop.
    with pytest.raises(RuntimeError, match="Prepared"):
        _ = parsed.rendered
    with pytest.raises(RuntimeError, match="Prepared"):
        router.routing_request(parsed, {}, "r")
    request = router.routing_request(parsed, {}, "r", prepared)
    assert request.block_hashes == prepared.block_hashes and request.prompt_bytes > 1000
    assert parses.sizes == [] and parsed.prompt is None and parsed.decoded is None


class RecordingParser(BodyParser):
    """The pool's part, recorded (no process started)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.bodies: list[int] = []

    async def prepare(self, api: Api, body: bytes, index: PrefixIndexConfig) -> Prepared:
        self.bodies.append(len(body))
        return Prepared(parse_request(api, body), 0, [])


@pytest.mark.parametrize(
    ("size", "with_parser", "decodes", "reads_payload", "where"),
    [
        (100, True, False, False, "loop"),
        (5000, True, False, False, "pool"),
        (5000, True, True, False, "thread"),  # disaggregation's prefill request decodes it
        (5000, True, False, True, "thread"),  # precise routing tokenizes the payload
        (5000, False, False, False, "thread"),  # offloadProcesses: 0
    ],
)
async def test_where_a_body_is_prepared(
    monkeypatch: pytest.MonkeyPatch, parses: Parses,
    size: int, with_parser: bool, decodes: bool, reads_payload: bool, where: str,
) -> None:
    config, router = _router(4096)
    monkeypatch.setattr(router, "reads_payload", reads_payload)
    parser = RecordingParser() if with_parser else None
    body = orjson.dumps({"model": MODEL, "prompt": "p" * size})
    preparer = BodyPreparer(config, router, parser)
    prepared = await preparer.prepare("completions", body, decodes_payload=decodes)
    assert prepared.parsed.model == MODEL
    pooled = parser.bodies if parser is not None else []
    on_loop = parses.threads == [threading.current_thread()]
    found = "pool" if pooled else "loop" if on_loop else "thread"
    assert found == where
    assert len(pooled) + len(parses.threads) == 1, "parsed once"


async def test_a_large_body_is_joined_in_a_thread_and_a_small_one_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    joined_in: list[str] = []
    real = asyncio.to_thread

    async def recording(func: Any, /, *args: Any) -> Any:
        joined_in.append("thread")
        return await real(func, *args)

    monkeypatch.setattr(request_body.asyncio, "to_thread", recording)
    big = [b"x" * (request_body.JOIN_IN_THREAD_BYTES // 2)] * 2
    assert await request_body.join_body(big, sum(map(len, big))) == b"".join(big)
    assert await request_body.join_body([b"a", b"b"], 2) == b"ab"
    assert await request_body.join_body([b"whole"], 5) == b"whole"
    assert joined_in == ["thread"]


async def test_only_a_large_bodys_model_is_read_in_the_parsers_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routes that read nothing but the model (token counting) keep a large body off the loop
    too: orjson holds the GIL for the whole decode."""
    read_here: list[int] = []

    def model_here(body: bytes) -> str:
        read_here.append(len(body))
        return parsing.model_of(body)

    monkeypatch.setattr(request_body, "model_of", model_here)
    config = parse_config({"pool": {"endpoints": [{"url": "http://127.0.0.1:9"}]},
                           "server": {"offloadBodyBytes": 4096}})
    parser = BodyParser(1)
    preparer = BodyPreparer(config, build_gateway(config).router, parser)
    small = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    large = orjson.dumps({"messages": [{"role": "user", "content": "x" * 8192}], "model": "m"})
    try:
        assert await preparer.model(small) == "m"
        assert await preparer.model(large) == "m"
        with pytest.raises(BadRequestError):
            await preparer.model(orjson.dumps({"messages": [], "pad": "x" * 8192}))
    finally:
        await parser.aclose()
    assert read_here == [len(small)], "the large ones were read in the parser's process"
