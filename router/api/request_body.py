"""Reading a request's body: bounded in size and in time, refused early when it says it is
too big (an unauthenticated or careless client must not make the gateway buffer 32 MB); and
parsing a large one off the event loop (:class:`BodyPreparer`, :class:`BodyParser`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from starlette.types import Receive

from router.api.deadlines import Deadlines
from router.config.model import GatewayConfig, PrefixIndexConfig
from router.core.errors import ClientCancelledError, PayloadTooLargeError, RequestTimeoutError
from router.protocol.parsing import (
    Api,
    Digest,
    digest_body,
    digest_file,
    model_of,
    model_of_file,
)
from router.scheduling.routing import Prepared, Router

log = logging.getLogger("prefixgate.proxy")
# CPython's bytes.join releases the GIL from 1 MiB on (Objects/stringlib/join.h).
JOIN_IN_THREAD_BYTES = 1024 * 1024


async def read_body(
    receive: Receive, declared: str | None, limit: int, deadline_s: float, deadlines: Deadlines
) -> bytes:
    """The whole body; a 413 beyond ``limit`` bytes (at once when the Content-Length,
    ``declared``, says so), a 408 when it takes over ``deadline_s`` seconds, and the task
    cancelled when the client leaves meanwhile.

    Read from the ASGI messages directly, under a coarse deadline: Starlette's stream
    generator and ``asyncio.timeout`` cost more than the read itself for the usual body."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    timer = deadlines.start(deadline_s)
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientCancelledError("the client left while sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if timer.absorb_expiry():
            raise RequestTimeoutError("the request body did not arrive in time") from None
        raise
    finally:
        timer.stop()
    return await join_body(chunks, size)


async def join_body(chunks: list[bytes], size: int) -> bytes:
    """A body's pieces as one, joined in a thread when large: bytes.join copies this much
    without the GIL, 20 ms for 30 MB not spent on the loop."""
    if len(chunks) == 1:
        return chunks[0]
    if size >= JOIN_IN_THREAD_BYTES:
        return await asyncio.to_thread(b"".join, chunks)
    return b"".join(chunks)


_T = TypeVar("_T")


class BodyParser:
    """Parses, renders and hashes large bodies in a small pool of processes.

    Not a thread: ``orjson.loads`` holds the GIL for its whole run (about 130 ms for 30 MB),
    so a worker thread stalls the event loop just as well. The processes are spawned (the
    gateway runs threads, which fork does not mix with) on first use, since most gateways
    never see a body this big, and shut down with the gateway. What comes back is a
    :class:`Digest`; the raw body is forwarded from the gateway's own copy, unchanged.
    """

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("a body parser needs at least one process")
        self._processes = processes
        self._pool: asyncio.Future[ProcessPoolExecutor] | None = None
        self._closed = False  # after aclose, large bodies go to a thread: no new pool
        self.digested = 0  # bodies parsed by the pool's processes (digests and models)

    async def digest(self, api: Api, body: bytes, block_bytes: int, max_blocks: int) -> Digest:
        """:func:`router.parsing.digest_body` in a pool process (a BadRequestError as there)."""
        return await self._parse(
            body,
            functools.partial(digest_file, api, block_bytes=block_bytes, max_blocks=max_blocks),
            functools.partial(digest_body, api, block_bytes=block_bytes, max_blocks=max_blocks),
        )

    async def model(self, body: bytes) -> str:
        """:func:`router.parsing.model_of` in a pool process."""
        return await self._parse(body, model_of_file, model_of)

    async def _parse(
        self, body: bytes, of_file: Callable[[str], _T], of_body: Callable[[bytes], _T]
    ) -> _T:
        """``of_file`` of the body in a pool process.

        The body goes over in a temporary file, written from a worker thread: a file write
        copies without the GIL, where pickling it for the pool's pipe would hold the GIL
        (25 ms and more for 30 MB). Should the pool fail (a process killed for memory, no
        room for the file), ``of_body`` parses this body in a thread and the next body starts
        a new pool.
        """
        if self._closed:
            return await asyncio.to_thread(of_body, body)
        try:
            # Made on the loop (one system call), so the file is removed below even when the
            # task is cancelled while the thread still writes it.
            fd, path = tempfile.mkstemp(prefix="prefixgate-body-")
        except OSError as exc:
            log.warning("no temporary file for a large body (%r); parsing it in a thread", exc)
            return await asyncio.to_thread(of_body, body)
        try:
            try:
                await asyncio.to_thread(_spill, fd, body)
            except OSError as exc:  # no room for the file: the pool itself is fine
                log.warning("could not spill a large body (%r); parsing it in a thread", exc)
                return await asyncio.to_thread(of_body, body)
            started = self._started()
            try:
                pool = await asyncio.shield(started)
            except Exception as exc:  # the processes could not be started
                log.warning("the body parser did not start (%r); parsing in a thread", exc)
                self._discard(started)
                return await asyncio.to_thread(of_body, body)
            try:
                parsed = await asyncio.get_running_loop().run_in_executor(pool, of_file, path)
            except (BrokenProcessPool, OSError) as exc:
                log.warning("the body parser failed (%r); parsing this body in a thread", exc)
                self._discard(started)
                return await asyncio.to_thread(of_body, body)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # read and removed by the process, unless it failed first
        self.digested += 1
        return parsed

    async def prepare(self, api: Api, body: bytes, index: PrefixIndexConfig) -> Prepared:
        """What :meth:`Router.prepare` gives, from the pool (the payload decoded on demand)."""
        digest = await self.digest(api, body, index.block_bytes, index.max_blocks_per_request)
        return Prepared(digest.parsed(api, body), digest.prompt_bytes, digest.block_hashes)

    def _started(self) -> asyncio.Future[ProcessPoolExecutor]:
        """The pool, its processes spawned from a worker thread on first use: spawning holds
        the caller until the child has started (tens of ms on a busy machine)."""
        if self._pool is None:
            self._pool = asyncio.ensure_future(asyncio.to_thread(self._spawn))
        return self._pool

    def _discard(self, started: asyncio.Future[ProcessPoolExecutor]) -> None:
        """Drop a pool that failed, so the next large body starts a new one. Its queued work
        is not cancelled: a broken pool fails it, and each of those bodies goes to a thread."""
        if self._pool is not started:
            return
        self._pool = None
        if started.done() and not started.cancelled() and started.exception() is None:
            started.result().shutdown(wait=False)

    def _spawn(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self._processes, mp_context=multiprocessing.get_context("spawn"))
        for _ in range(self._processes):
            pool.submit(int)  # each submission spawns a process until there are enough
        return pool

    async def aclose(self) -> None:
        self._closed = True
        started, self._pool = self._pool, None
        if started is None:
            return
        with contextlib.suppress(OSError):
            pool = await started
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)


class BodyPreparer:
    """Where a body is parsed, rendered and hashed, for every front door alike (the HTTP
    proxy, the ext_proc picker): a small one here, on the loop; a large one in the parser's
    process, or in a thread when the caller reads the decoded body."""

    def __init__(self, config: GatewayConfig, router: Router, parser: BodyParser | None) -> None:
        self._offload_bytes = config.server.offload_body_bytes
        self._index = config.prefix_index
        self._router = router
        # Large bodies' parser (None: they are parsed in a worker thread).
        self.parser = parser

    async def prepare(self, api: Api, body: bytes, *, decodes_payload: bool) -> Prepared:
        """``decodes_payload``: the caller reads the decoded body (disaggregation's prefill
        request), as precise routing does: then a large body is parsed in a thread, since
        one parsed in the pool comes back undecoded and would be decoded on the loop."""
        if len(body) < self._offload_bytes:
            return self._router.prepare(api, body)
        if self.parser is not None and not decodes_payload and not self._router.reads_payload:
            return await self.parser.prepare(api, body, self._index)
        return await asyncio.to_thread(self._router.prepare, api, body)

    async def model(self, body: bytes) -> str:
        """Only the body's ``model``: a small body's decoded here, a large one's in the
        parser's process (or a thread)."""
        if len(body) < self._offload_bytes:
            return model_of(body)
        if self.parser is not None:
            return await self.parser.model(body)
        return await asyncio.to_thread(model_of, body)


def _spill(fd: int, body: bytes) -> None:
    """``body`` into the temporary file open at ``fd`` (closed after)."""
    with open(fd, "wb", buffering=0) as f:  # unbuffered: one copy, by the kernel
        view, written = memoryview(body), 0
        while written < len(body):
            written += f.write(view[written:])
