"""Failover: one request's attempts at the ranked endpoints, in order, until one answers.

A connect error, a timeout or a 5xx before the first byte moves on to the next endpoint
(bounded by ``proxy.maxAttempts``, counting the attempts sent: an endpoint down, ejected or
gone since the ranking is skipped); a 4xx is the client's and is the answer. The last
attempt's 5xx is the answer too, as is a 5xx with no endpoint left to try. Connect errors,
timeouts and 5xx (never 4xx) count towards the endpoint's outlier ejection.

The first attempt's pick is recorded before it is sent, so that the next requests of a burst
already see it; should that attempt fail before its first byte, the prefix index's record is
withdrawn (the blocks it added: the endpoint prefilled nothing). A retry's is recorded once its
endpoint has answered, and not when that answer is a 5xx (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

from router.api.attempt import Attempt
from router.config.model import ProxyConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import UpstreamError, UpstreamTimeoutError
from router.core.framework import RoutingRequest
from router.core.lease import Lease
from router.pool.metrics import GatewayMetrics
from router.protocol.exchange import Exchange
from router.scheduling.routing import Router
from router.upstream.client import UPSTREAM_ERRORS

log = logging.getLogger("prefixgate.proxy")

# Sends the request to one endpoint and waits for its answer's first chunk (router/api/attempt.py).
Send = Callable[[EndpointSnapshot], Awaitable[Attempt]]


@dataclass(frozen=True, slots=True)
class Answered:
    """The attempt that answered, at the endpoint it went to, under that endpoint's lease."""

    attempt: Attempt
    endpoint: EndpointSnapshot
    lease: Lease


class Failover:
    def __init__(self, config: ProxyConfig, router: Router, metrics: GatewayMetrics) -> None:
        self._max_attempts = config.max_attempts
        self._router = router
        self._metrics = metrics
        self._ejections = Counter(
            "prefixgate_endpoint_ejections",
            "Times an endpoint was ejected after consecutive failures (passive health).",
            ["endpoint"],
            registry=metrics.registry,
        )

    async def first_answer(
        self,
        routing: RoutingRequest,
        ranked: list[EndpointSnapshot],
        send: Send,
        ex: Exchange,
        ranked_earlier: bool = False,
    ) -> Answered:
        """The first endpoint's answer that is not a failure to move on from.

        ``ranked_earlier``: ``ranked`` is from before an await (a prefill step)."""
        last_error: BaseException | None = None
        # A 5xx, held while no other endpoint is tried: the answer should none be.
        refused: Answered | None = None
        sent = 0
        for n, endpoint in enumerate(ranked):
            if sent == self._max_attempts:
                break
            if n or ranked_earlier:  # the lease reads the endpoint's queue as it is now
                now = self._router.current(routing.model, endpoint.id)
                if now is None:
                    continue  # down, ejected or gone since it was ranked: no attempt
                endpoint = now
            try:
                lease = self._router.lease(routing, endpoint)
            except KeyError:
                continue  # the endpoint left the pool since it was ranked
            if refused is not None:
                refused.lease.release()
                refused.attempt.reply.close()
                refused = None
            sent += 1
            ex.attempts += 1
            recorded = ex.attempts == 1
            if recorded:
                self._router.picked(routing, endpoint.id)
            else:
                self._metrics.retries.inc()
            try:
                attempt = await send(endpoint)
            except UPSTREAM_ERRORS as exc:
                self._unreached(routing, endpoint.id, lease, exc)
                if recorded:
                    self._router.unpicked(routing, endpoint.id)
                last_error = exc
                continue
            except BaseException:  # the client left, say: no failure of the endpoint's
                lease.release()
                raise
            if attempt.reply.status < 500:
                lease.upstream_ok()
                if ex.attempts > 1:
                    self._router.picked(routing, endpoint.id)
            else:
                self.failed(lease, endpoint.id, "5xx")
                if recorded:
                    self._router.unpicked(routing, endpoint.id)
                refused = Answered(attempt, endpoint, lease)
                continue
            return Answered(attempt, endpoint, lease)
        if refused is not None:  # no endpoint left to try: the last attempt's 5xx is the answer
            return refused
        if isinstance(last_error, TimeoutError):
            raise UpstreamTimeoutError("no endpoint answered within the first-byte timeout")
        reason = type(last_error).__name__ if last_error is not None else "none left"
        raise UpstreamError(f"no endpoint could be reached ({reason})")

    def _unreached(
        self, routing: RoutingRequest, endpoint_id: str, lease: Lease, exc: BaseException
    ) -> None:
        """An attempt that got no answer (a connect error, a timeout)."""
        lease.release()
        kind = "timeout" if isinstance(exc, TimeoutError) else "transport"
        self.failed(lease, endpoint_id, kind)
        log.warning("request %s: %s on %s: %r", routing.request_id, kind, endpoint_id, exc)

    def failed(self, lease: Lease, endpoint_id: str, kind: str) -> None:
        """Count an endpoint's failure (a relay's mid-stream error too) towards its ejection."""
        self._metrics.upstream_failures.labels(endpoint_id, kind).inc()
        if lease.upstream_failed():
            self._ejections.labels(endpoint_id).inc()

