"""One attempt at an endpoint: the request sent, and the first chunk of its answer awaited
under the first-byte timeout. The proxy retries on the next endpoint when an attempt fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from router.api.deadlines import Deadlines
from router.upstream.client import UpstreamClient, UpstreamReply

# A stream's opening events are a few kilobytes: past this, relay what came, token or not.
_MAX_HELD = 1 << 20


@dataclass(slots=True)
class Attempt:
    reply: UpstreamReply
    first_chunk: bytes


async def open_attempt(
    client: UpstreamClient, deadlines: Deadlines, timeout_s: float,
    method: str, url: str, headers: list[tuple[str, str]], body: bytes,
    opening: Callable[[bytes], bool] | None = None,
) -> Attempt:
    """Send a request upstream and wait for the first chunk of its answer, under the
    first-byte timeout (TimeoutError); a transport error propagates as it is.

    ``opening``: true while a successful answer's chunks so far are only the events a stream
    sends before its first token (a Responses stream's, sent as soon as the replica accepts
    the request). They are held back and the wait goes on: until the first token, the attempt
    can still time out and go to another endpoint, with nothing sent to the client."""
    reply: UpstreamReply | None = None
    timer = deadlines.start(timeout_s)
    try:
        reply = await client.request(method, url, headers, body)
        first = await reply.next_chunk()
        if opening is not None and reply.status == 200:
            first = await _past_opening(reply, first, opening)
    except BaseException as exc:
        if reply is not None:
            reply.close()
        if isinstance(exc, asyncio.CancelledError) and timer.absorb_expiry():
            raise TimeoutError("no first byte within the timeout") from None
        raise
    finally:
        timer.stop()
    return Attempt(reply, first)


async def _past_opening(
    reply: UpstreamReply, held: bytes, opening: Callable[[bytes], bool]
) -> bytes:
    """``held`` and what follows it, up to the chunk that ends the opening (or the answer)."""
    while held and opening(held) and not reply.ended and len(held) < _MAX_HELD:
        more = await reply.next_chunk()
        if not more:
            break
        held += more
    return held
