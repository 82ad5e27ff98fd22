"""The relay's idle deadline: one per stream, each side of the relay under the timeout."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from starlette.types import Message

from router.api.deadlines import TICK_S, Deadlines
from router.api.streaming import DisconnectWatch, FirstToken, ServerSend, UpstreamResponse
from router.core.lease import Lease
from router.upstream.client import UpstreamReply
from router.upstream.connection import UpstreamConnectionError
from tests import virtual_clock


def test_idle_deadline_cancels_only_after_a_quiet_timeout() -> None:
    # On a virtual clock (tests/virtual_clock.py): a loaded machine's stalls cannot pass for
    # quiet time, and the expiry's moment is exact.
    async def steady() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        idle = Deadlines().start(0.1)
        try:
            for _ in range(10):  # 0.9 s in all, never 0.1 s without a touch
                await asyncio.sleep(0.09)
                idle.touch()
        finally:
            idle.stop()
        return loop.time() - started

    assert virtual_clock.run(steady()) == pytest.approx(0.9)

    async def quiet() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        idle = Deadlines().start(0.1)
        try:
            await asyncio.sleep(0.05)
            idle.touch()  # the timeout counts from here
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return "expired" if idle.absorb_expiry() else "cancelled", loop.time() - started
        return "slept", loop.time() - started

    # Checked on a coarse tick: it fires once due, and at most one tick late.
    outcome, seconds = virtual_clock.run(quiet())
    assert outcome == "expired" and 0.15 <= seconds <= 0.15 + TICK_S + 1e-9


def test_idle_deadline_leaves_another_cancellation_standing() -> None:
    async def waits() -> bool:
        idle = Deadlines().start(0.05)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return idle.absorb_expiry()
        return False

    async def main() -> bool:
        task = asyncio.create_task(waits())
        await asyncio.sleep(0.01)
        task.cancel()  # a disconnect, say, before the timer is due: not the timer's to absorb
        return await task

    assert virtual_clock.run(main()) is False


class FakeUpstream:
    status = 200
    raw_headers: list[tuple[bytes, bytes]] = []
    content_type = "text/event-stream"

    def __init__(
        self, chunks: list[bytes], stall_after: int | None = None, end_apart: bool = False
    ) -> None:
        self.chunks = chunks
        self.stall_after = stall_after
        # The body's end read apart from its last chunk (vLLM's last chunk, then the
        # terminating zero-length chunk in a segment of its own).
        self.end_apart = end_apart
        self.closed = False

    @property
    def ended(self) -> bool:
        return not self.chunks and self.stall_after is None and not self.end_apart

    async def next_chunk(self) -> bytes:
        if self.stall_after is not None and not self.chunks[self.stall_after :]:
            await asyncio.sleep(60)
        return self.chunks.pop(0) if self.chunks else b""

    def close(self) -> None:
        self.closed = True


class FakeLease:
    released = False

    def release(self) -> None:
        self.released = True


async def _relay(upstream: FakeUpstream, send_blocks_at: int | None) -> tuple[str, list[bytes]]:
    outcomes: list[str] = []
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            if send_blocks_at is not None and len(sent) == send_blocks_at:
                await asyncio.sleep(60)  # a client that stopped reading
            sent.append(message["body"])

    watch = DisconnectWatch(receive)
    watch.start()
    response = UpstreamResponse(
        cast(UpstreamReply, upstream), b"data: 0\n\n", [], lease=cast(Lease, FakeLease()),
        watch=watch, idle_timeout=0.1, deadlines=Deadlines(), on_finish=outcomes.append,
    )
    await asyncio.wait_for(response({}, receive, send), 3)
    assert upstream.closed
    return outcomes[0], sent


@pytest.mark.parametrize(
    ("stall_after", "send_blocks_at", "outcome"),
    [(None, None, "ok"), (2, None, "stream_error"), (None, 2, "client_stalled")],
)
def test_relay_outcomes(stall_after: int | None, send_blocks_at: int | None,
                       outcome: str) -> None:
    upstream = FakeUpstream([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"], stall_after)
    # Virtual clock: only a stalled side can reach the idle timeout, not a slow machine.
    got, sent = virtual_clock.run(_relay(upstream, send_blocks_at))
    assert got == outcome
    if outcome == "ok":
        # The last chunk ends the body: no separate (empty) message, so one write fewer.
        assert sent == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]
    elif outcome == "stream_error":  # the replica went quiet: an error event ends the stream
        assert b"idle timeout" in sent[-2] and sent[-1] == b""


async def test_body_chunks_skip_the_framework_send_wrappers() -> None:
    """The start goes through the framework's ``send`` (its layers watch for it); the relayed
    chunks go straight to the server's, which ServerSend put in the scope."""
    through: list[str] = []
    direct: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def wrapped(message: Message) -> None:  # what an error-handling layer does
            through.append(message["type"])
            await send(message)

        async def receive_nothing() -> dict[str, Any]:
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        watch = DisconnectWatch(receive_nothing)
        watch.start()
        upstream = FakeUpstream([b"data: 1\n\n", b"data: 2\n\n"])
        response = UpstreamResponse(
            cast(UpstreamReply, upstream), b"data: 0\n\n", [], lease=cast(Lease, FakeLease()),
            watch=watch, idle_timeout=1.0, deadlines=Deadlines(),
            on_finish=lambda _: None,
        )
        await response(scope, receive, wrapped)

    async def server_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            direct.append(message["body"])

    await asyncio.wait_for(ServerSend(app)({"type": "http"}, None, server_send), 3)  # type: ignore[arg-type]
    assert through == ["http.response.start", "http.response.body"]
    assert direct == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]


async def test_an_answer_complete_in_its_first_chunk_is_one_body_message() -> None:
    upstream = FakeUpstream([])
    got, sent = await _relay(upstream, None)
    assert (got, sent) == ("ok", [b"data: 0\n\n"])


class FirstByteLease:
    def __init__(self) -> None:
        self.first_bytes: list[tuple[bool, bool]] = []

    def first_byte(self, tokens: bool = True, answered: bool = True) -> None:
        self.first_bytes.append((tokens, answered))


def test_the_first_token_tap_tells_the_lease_once_and_hands_every_chunk_on() -> None:
    lease, seen = FirstByteLease(), []
    tap = FirstToken(cast(Lease, lease), lambda chunk: int(b"delta" in chunk), seen.append)
    for chunk in (b"created", b"in_progress", b"delta 1", b"delta 2"):
        tap(chunk)
        assert lease.first_bytes == ([(True, True)] if b"delta" in chunk else [])
    assert seen == [b"created", b"in_progress", b"delta 1", b"delta 2"]


def test_an_error_before_any_token_is_no_time_to_first_token() -> None:
    lease = FirstByteLease()
    tap = FirstToken(cast(Lease, lease), lambda chunk: 2 if b"error" in chunk else 0)
    for chunk in (b"created", b"error", b"later"):
        tap(chunk)
    assert lease.first_bytes == [(False, False)]


class CutUpstream(FakeUpstream):
    """A JSON answer whose replica dies after its first chunk."""

    content_type = "application/json"

    async def next_chunk(self) -> bytes:
        raise UpstreamConnectionError("the endpoint closed the connection")


async def test_a_json_answer_cut_mid_body_is_left_unended_for_the_server_to_cut() -> None:
    got, sent = await _relay(CutUpstream([b"more"]), None)
    # No end of body: uvicorn then closes the connection, and the client, short of the
    # length or the chunks' end, knows the answer is incomplete.
    assert (got, sent) == ("stream_error", [b"data: 0\n\n"])


@pytest.mark.parametrize(
    ("stall_after", "end_apart", "blocked_send"),
    [(None, True, 4), (2, False, 3)],
    ids=["the body's end", "the error event"],
)
def test_every_send_of_a_relay_is_under_the_idle_timeout(
    stall_after: int | None, end_apart: bool, blocked_send: int
) -> None:
    """A client that stops reading just before the body's end (or an error event) must not
    hold the request, its ticket and its lease for as long as its connection lives."""
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]
    upstream = FakeUpstream(chunks, stall_after, end_apart)
    got, sent = virtual_clock.run(_relay(upstream, blocked_send))
    assert got == "client_stalled"
    assert len(sent) == blocked_send
