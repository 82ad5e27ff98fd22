"""The Envoy ext_proc endpoint picker: Envoy asks, over one gRPC stream per HTTP request, where
the request should go; prefixgate answers through the same
:class:`~router.scheduling.routing.Router` as
its HTTP front door (flow control, prefix index, affinity), so both shapes route alike.

Each stream is one :class:`~router.extproc.exchange.Exchange` (router/extproc/exchange.py): the
request's phases, its pick, and its release.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from router.app import Gateway
from router.config.model import ExtProcConfig
from router.extproc.exchange import Exchange
from router.extproc.metrics import ExtProcMetrics


class ExtProcService:
    """``envoy.service.ext_proc.v3.ExternalProcessor``, registered by its generated adder."""

    def __init__(self, gateway: Gateway, settings: ExtProcConfig) -> None:
        self._gateway = gateway
        self._settings = settings
        self._candidates = gateway.stores.candidates(gateway.pool)
        self.metrics = ExtProcMetrics(gateway.metrics.registry)

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        exchange = Exchange(self._gateway, self._settings, self._candidates, self.metrics)
        self.metrics.streams.inc()
        try:
            async for message in requests:
                for answer in await exchange.handle(message):
                    yield answer
                if exchange.done:
                    return
        finally:
            # Envoy closes the stream when the HTTP request ends or is reset: release now.
            exchange.close()
            self.metrics.streams.dec()
