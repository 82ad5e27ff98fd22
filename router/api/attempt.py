"""One attempt at an endpoint: the request sent, and the first chunk of its answer awaited
under the first-byte timeout. The proxy retries on the next endpoint when an attempt fails."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from router.api.deadlines import Deadlines
from router.upstream.client import UpstreamClient, UpstreamReply


@dataclass(slots=True)
class Attempt:
    reply: UpstreamReply
    first_chunk: bytes


async def open_attempt(
    client: UpstreamClient, deadlines: Deadlines, timeout_s: float,
    method: str, url: str, headers: list[tuple[str, str]], body: bytes,
) -> Attempt:
    """Send a request upstream and wait for the first chunk of its answer, under the
    first-byte timeout (TimeoutError); a transport error propagates as it is."""
    reply: UpstreamReply | None = None
    timer = deadlines.start(timeout_s)
    try:
        reply = await client.request(method, url, headers, body)
        first = await reply.next_chunk()
    except BaseException as exc:
        if reply is not None:
            reply.close()
        if isinstance(exc, asyncio.CancelledError) and timer.absorb_expiry():
            raise TimeoutError("no first byte within the timeout") from None
        raise
    finally:
        timer.stop()
    return Attempt(reply, first)
