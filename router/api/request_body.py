"""Reading a request's body: bounded in size and in time, refused early when it says it is
too big (an unauthenticated or careless client must not make the gateway buffer 32 MB)."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from router.core.errors import PayloadTooLargeError, RequestTimeoutError


async def read_body(request: Request, limit: int, deadline_s: float) -> bytes:
    """The whole body; a 413 beyond ``limit`` bytes, a 408 when it takes over ``deadline_s``
    seconds, and the task cancelled when the client leaves meanwhile."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect:
        raise asyncio.CancelledError from None
    except TimeoutError:
        raise RequestTimeoutError("the request body did not arrive in time") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
