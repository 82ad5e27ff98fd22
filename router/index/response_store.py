"""Which endpoint produced each stored response of the OpenAI Responses API.

A stored response (the conversation behind ``previous_response_id``, ``GET``, ``DELETE`` and
``cancel``) lives on the one replica that produced it, so every request naming it must go
there: any other replica answers 404, or worse, a follow-up without its history. The gateway
learns ``response id -> endpoint`` from the answers it relays (:class:`ResponseIdTap`) and
:meth:`ResponseRoutes.resolve` pins requests naming an id to that endpoint.

The map is a bounded LRU with a TTL in memory; with the Redis backend it is also shared by every
gateway replica (``pg:<namespace>:resp:<id>``, expiring with the TTL; no hash tag, so keys spread
over a Cluster's slots). Writes go out in the background; a read asks the local map first (an id
never moves), then Redis within its budget. An id found in neither (an expired entry, a gateway
restarted without Redis, a write still in flight from another gateway) is looked for on the
endpoints themselves with a bounded ``GET /v1/responses/{id}`` (the ``probe`` a
:class:`ResponseRoutes` is built with).

When the endpoint is known but cannot serve the request, the client gets a 4xx that says so,
never a wrong answer from another replica: 404 when the endpoint has left the pool (its stored
responses are gone with it), 409 while it is unhealthy or ejected (it may come back; OpenAI's
SDKs retry 409).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.errors import BadRequestError, ResponseNotFoundError, ResponseUnavailableError
from router.core.pool import EndpointPool
from router.index.redis_link import (
    RedisClient,
    RedisLink,
    RedisMetrics,
    default_metrics,
    key_tag,
)
from router.index.update_queue import UpdateQueue

# Whether an endpoint holds a response: True, False (it says not: 404), None (no answer).
Probe = Callable[[EndpointSnapshot, str], Awaitable[bool | None]]
# Ids are echoed into Redis keys, URLs and logs: only plain tokens are accepted.
# How long an id no endpoint holds is answered 404 without asking them again, and how many.
MISS_TTL_S = 10.0
MAX_MISSES = 10_000
RESPONSE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,256}")
_ID_IN_BODY = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9._:\-]{1,256})"')


class ResponseIdTap:
    """Watches the first bytes of a relayed answer for the response's id, then stops.

    The id is the first ``"id"`` of the body in both shapes vLLM and OpenAI send: a response
    object starts with it, and a stream starts with ``response.created`` whose response object
    does. Called with each chunk before it is passed on, so the id is known before the client
    can send a follow-up naming it.
    """

    __slots__ = ("_buffer", "_limit", "_on_id", "done")

    def __init__(self, on_id: Callable[[str], None], limit: int = 16384) -> None:
        self._on_id = on_id
        self._limit = limit
        self._buffer = b""
        self.done = False

    def __call__(self, chunk: bytes) -> None:
        if self.done:
            return
        self._buffer += chunk[: self._limit - len(self._buffer)]
        match = _ID_IN_BODY.search(self._buffer)
        if match is not None:
            self.done = True
            self._on_id(match.group(1).decode())
        elif len(self._buffer) >= self._limit:
            self.done = True
        if self.done:
            self._buffer = b""


class ResponseRoutes:
    """``response id -> endpoint id``: local LRU with TTL, shared through Redis when given."""

    def __init__(
        self,
        ttl_seconds: float = 86400.0,
        max_entries: int = 100_000,
        *,
        url: str | None = None,
        namespace: str = "prefixgate",
        timeout_ms: float = 50.0,
        probe_timeout_seconds: float = 2.0,
        probe: Probe | None = None,
        metrics: RedisMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        cluster: bool = False,
    ) -> None:
        self._ttl = ttl_seconds
        self._max = max_entries
        self._clock = clock
        self._probe_timeout = probe_timeout_seconds
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # Ids the endpoints asked said they do not hold: until when, and which said so. A
        # client retrying an expired id must not ask the whole pool each time.
        self._misses: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()
        self._link: RedisLink | None = None
        self._queue: UpdateQueue[str, str | None] | None = None
        # Asks the endpoints for an id known nowhere else (router/api/stored_responses.py).
        self._probe = probe
        if url is not None:
            key_tag(namespace)
            self._prefix = f"pg:{namespace}:resp:"
            self._link = RedisLink(
                url,
                component="responses",
                metrics=default_metrics(metrics),
                timeout_ms=timeout_ms,
                cluster=cluster,
            )
            self._queue = UpdateQueue(
                self._ship, op="response_set", link=self._link, max_items=4096, max_batch=256
            )

    def __len__(self) -> int:
        return len(self._entries)

    def tap(self, endpoint_id: str) -> ResponseIdTap:
        return ResponseIdTap(lambda response_id: self.remember(response_id, endpoint_id))

    def remember(self, response_id: str, endpoint_id: str) -> None:
        if not RESPONSE_ID.fullmatch(response_id):
            return
        self._keep(response_id, endpoint_id)
        if self._queue is not None:
            self._queue.put(response_id, endpoint_id)

    def forget(self, response_id: str) -> None:
        self._entries.pop(response_id, None)
        if self._queue is not None:
            self._queue.put(response_id, None)

    def local(self, response_id: str) -> str | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[1] < self._clock():
            del self._entries[response_id]
            return None
        return entry[0]

    async def endpoint_of(self, response_id: str) -> str | None:
        """The endpoint remembered for ``response_id`` here or (within budget) in Redis."""
        found = self.local(response_id)
        if found is not None or self._link is None or not RESPONSE_ID.fullmatch(response_id):
            return found
        endpoint = await self._link.get_text("response_get", self._prefix + response_id)
        if endpoint is None:
            return None
        self._keep(response_id, endpoint)
        return endpoint

    def _keep(self, response_id: str, endpoint_id: str) -> None:
        """Remember locally, the oldest dropped past ``max_entries`` (ids read from Redis too:
        a gateway that mostly resolves others' ids would grow without bound)."""
        self._entries[response_id] = (endpoint_id, self._clock() + self._ttl)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def locate(self, response_id: str, candidates: Sequence[EndpointSnapshot]) -> str | None:
        """Ask every candidate whether it holds ``response_id`` (bounded); the first that does.
        When every one says it does not (a 404, not a failure), that is remembered for
        ``MISS_TTL_S``: candidates all among them are not asked again meanwhile."""
        probe = self._probe
        if probe is None or not candidates or self._probe_timeout <= 0:
            return None
        missed = self._misses.get(response_id)
        if missed is not None and missed[0] > self._clock() and all(
            c.id in missed[1] for c in candidates
        ):
            return None
        tasks = {asyncio.ensure_future(probe(c, response_id)): c.id for c in candidates}
        pending = set(tasks)
        denied: set[str] = set()
        try:
            async with asyncio.timeout(self._probe_timeout):
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task.cancelled() or task.exception() is not None:
                            continue
                        if task.result():
                            return tasks[task]
                        if task.result() is False:
                            denied.add(tasks[task])
            if len(denied) == len(tasks):  # every candidate said it does not hold it
                self._missed(response_id, frozenset(denied))
        except TimeoutError:
            return None
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
        return None

    def _missed(self, response_id: str, denied: frozenset[str]) -> None:
        self._misses[response_id] = (self._clock() + MISS_TTL_S, denied)
        self._misses.move_to_end(response_id)
        while len(self._misses) > MAX_MISSES:
            self._misses.popitem(last=False)

    async def resolve(
        self,
        response_id: str,
        pool: EndpointPool,
        candidates: Sequence[EndpointSnapshot],
        param: str | None = None,
        model: str | None = None,
    ) -> str:
        """The endpoint a request naming ``response_id`` must go to, or the 4xx saying why none
        can take it. ``candidates`` are the endpoints able to serve the request now."""
        if not RESPONSE_ID.fullmatch(response_id):
            raise ResponseNotFoundError(
                f"Response with id '{response_id[:64]}' not found.", param=param
            )
        endpoint = await self.endpoint_of(response_id)
        if endpoint is None:
            endpoint = await self.locate(response_id, candidates)
            if endpoint is None:
                raise ResponseNotFoundError(
                    f"Response with id '{response_id}' not found.", param=param
                )
            self.remember(response_id, endpoint)
        if pool.get(endpoint) is None:
            raise ResponseNotFoundError(
                f"Response '{response_id}' was stored on endpoint {endpoint}, which has left "
                "the pool; its state is gone. Send the whole conversation instead.",
                param=param,
                code="response_endpoint_gone",
            )
        if all(c.id != endpoint for c in candidates):
            state = pool.get(endpoint)
            models = state.models if state is not None else set()
            if model is not None and models and model not in models:  # never will: no retry
                raise BadRequestError(
                    f"Response '{response_id}' is stored on endpoint {endpoint}, which does not "
                    f"serve model {model!r}; it serves {sorted(models)}.",
                    param=param,
                )
            raise ResponseUnavailableError(
                f"Response '{response_id}' is stored on endpoint {endpoint}, which cannot take "
                "this request now (unhealthy or ejected); retry later "
                "or send the whole conversation instead.",
                param=param,
                retry_after=5.0,
            )
        return endpoint

    async def _ship(self, batch: list[tuple[str, str | None]]) -> None:
        assert self._link is not None
        ttl_ms = max(1, int(self._ttl * 1000))

        async def run(client: RedisClient) -> None:
            pipe = client.pipeline(transaction=False)
            for response_id, endpoint_id in batch:
                if endpoint_id is None:
                    pipe.delete(self._prefix + response_id)
                else:
                    pipe.set(self._prefix + response_id, endpoint_id, px=ttl_ms)
            await pipe.execute()

        await self._link.call("response_set", run, max(self._link.timeout, 0.05))

    async def flush(self) -> None:
        if self._queue is not None:
            await self._queue.flush()

    async def aclose(self, grace: float = 0.5) -> None:
        if self._queue is not None and self._link is not None:
            await self._queue.aclose(grace)
            await self._link.aclose()
