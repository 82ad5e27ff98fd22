"""``POST /v1/messages/count_tokens``: Anthropic's token count of a Messages request, which
Claude Code asks for to size its context. vLLM answers it by tokenizing, with no work on the
GPU, so the gateway passes it to the least loaded endpoint serving the model: no flow control,
no prefix index, errors in Anthropic's shape.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from router.api.passthrough import pass_through
from router.api.proxy import Proxy
from router.core.endpoints import EndpointSnapshot
from router.core.errors import ModelNotFoundError, NoEndpointsError
from router.core.pool import EndpointPool
from router.protocol.headers import request_id_of

PATH = "/v1/messages/count_tokens"


class TokenCounting:
    def __init__(
        self,
        pool: EndpointPool,
        candidates: Callable[[str], list[EndpointSnapshot]],
        proxy: Proxy,
        idle_timeout: float,
    ) -> None:
        self._pool = pool
        self._candidates = candidates
        self._proxy = proxy
        self._idle_timeout = idle_timeout

    async def handle(self, request: Request) -> Response:
        proxy = self._proxy
        tenant = proxy.auth.authenticate(request.headers) if proxy.auth is not None else None
        body = await proxy.read_body(request)
        model = await proxy.preparer.model(body)  # a large body's off the loop
        if not self._pool.knows_model(model):
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        candidates = self._candidates(model)
        if not candidates:
            raise NoEndpointsError(f"no healthy endpoint serves model {model!r}")
        endpoint = min(candidates, key=lambda c: c.in_flight)
        request_id = request_id_of(request.headers)
        headers = proxy.upstream_headers(request, request_id, tenant, endpoint.id)
        return await pass_through(
            proxy, self._pool, request, endpoint.id, endpoint.url + PATH, headers, body,
            request_id, "the endpoint counting the tokens", self._idle_timeout,
        )
