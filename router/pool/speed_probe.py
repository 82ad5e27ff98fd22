"""The speed probe: a few tiny completions timed on each endpoint as it becomes healthy.

Replicas of one pool are not always alike (GPU generations, a throttled node, a noisy
neighbour), and the cost model learns an endpoint's speed only from first bytes of traffic.
Sessions placed before any answer came back stay where their context is cached, so a slow
replica found late keeps its sessions slow. The fastest of a few one-token completions, each of
a short prompt no cache holds, measures the endpoint's own fixed and per-token cost with
nothing queued; the calibrator takes its ratio to the fleet's median as the speed factor's
prior (router/estimators/calibration.py), which traffic then outweighs. Why and what it costs:
docs/routing.md ("The speed probe").
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping

import orjson

from router.core.endpoints import EndpointState
from router.core.tasks import cancel_all
from router.upstream.client import UPSTREAM_ERRORS, UpstreamClient

log = logging.getLogger("prefixgate.speed_probe")

# Ordinary words, so that any tokenizer cuts them into about one token each.
_FILLER = "the quick brown fox jumps over the lazy dog while the gateway times this reply "
MAX_ANSWER_BYTES = 1 << 16


class SpeedProbe:
    """Owns one probing task per endpoint at a time; started from the monitor's health checks,
    stopped by the app's lifespan. The client is the composition root's, which closes it."""

    def __init__(
        self,
        client: UpstreamClient,
        on_probed: Callable[[str, float], None],
        *,
        requests: int = 3,
        prompt_bytes: int = 256,
        timeout_s: float = 2.0,
        auth_headers: Callable[[str], Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        nonce: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        self._client = client
        self._on_probed = on_probed
        self._requests = requests
        self._prompt_bytes = prompt_bytes
        self._timeout_s = timeout_s
        self._auth_headers = auth_headers
        self._clock = clock
        self._nonce = nonce
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def endpoint_up(self, state: EndpointState) -> None:
        """The endpoint just passed its health check (at start-up, or back from failing): time
        it, unless a probe of it is under way."""
        endpoint_id = state.endpoint.id
        task = self._tasks.get(endpoint_id)
        if task is not None and not task.done():
            return
        model = _model(state)
        if model is None:
            log.debug("endpoint %s lists no model: not probed", endpoint_id)
            return
        self._tasks[endpoint_id] = asyncio.create_task(
            self._probe(endpoint_id, state.endpoint.url, model), name=f"probe:{endpoint_id}"
        )

    async def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for the probes under way (start-up: placements made
        before them would not know the endpoints' speeds)."""
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending and timeout_s > 0:
            await asyncio.wait(pending, timeout=timeout_s)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        task = self._tasks.pop(endpoint_id, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        await cancel_all(self._tasks)

    async def _probe(self, endpoint_id: str, url: str, model: str) -> None:
        """One after another, so that none waits behind another; the fastest counts (a stall
        or a queue met by one is not the endpoint's speed)."""
        times = []
        try:
            for _ in range(self._requests):
                seconds = await self._one(endpoint_id, url, model)
                if seconds is None:
                    break  # an endpoint that fails one is not timed on the rest
                times.append(seconds)
        except Exception:  # a bug here must not go unseen, nor take the gateway down
            log.exception("endpoint %s: speed probe failed", endpoint_id)
            return
        if times:
            log.info("endpoint %s: speed probe %.1f ms", endpoint_id, 1e3 * min(times))
            self._on_probed(endpoint_id, min(times))

    async def _one(self, endpoint_id: str, url: str, model: str) -> float | None:
        # A nonce first, so that no cache holds even the prompt's first block.
        text = f"{self._nonce()} {_FILLER * (self._prompt_bytes // len(_FILLER) + 1)}"
        body = orjson.dumps(
            {"model": model, "prompt": text[: self._prompt_bytes], "max_tokens": 1,
             "temperature": 0}
        )  # fmt: skip
        headers = [("content-type", "application/json")]
        if self._auth_headers is not None:
            headers += list(self._auth_headers(endpoint_id).items())
        started = self._clock()
        try:
            reply = await self._client.fetch(
                "POST", url + "/v1/completions", headers, body, seconds=self._timeout_s,
                limit=MAX_ANSWER_BYTES,
            )
        except UPSTREAM_ERRORS as exc:
            log.debug("endpoint %s: speed probe failed: %r", endpoint_id, exc)
            return None
        if reply.status != 200:
            log.debug("endpoint %s: speed probe answered %d", endpoint_id, reply.status)
            return None
        return self._clock() - started


def _model(state: EndpointState) -> str | None:
    """A model the endpoint serves (the first by name: the same every time)."""
    models = state.endpoint.models or state.models
    return min(models) if models else None
