"""The error hierarchy of the gateway, translated to OpenAI-shaped JSON at the HTTP boundary.

Every error a client can see is a :class:`GatewayError`. Each subclass fixes the HTTP status,
the OpenAI ``type`` and, where llm-d defines one, the dropped reason (llm-d's values) sent in
``x-gateway-request-dropped-reason`` and in llm-d's own ``x-llm-d-request-dropped-reason``, so
that code raising an error never decides how it is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

DROPPED_REASON_HEADER = "x-gateway-request-dropped-reason"
LLMD_DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


class GatewayError(Exception):
    """Base class: an error answered to the client, never a crash."""

    status_code: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    dropped_reason: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.code if self.code is not None else self.status_code,
                }
            }
        )

    def headers(self) -> Mapping[str, str]:
        headers: dict[str, str] = {}
        if self.dropped_reason is not None:
            headers[DROPPED_REASON_HEADER] = self.dropped_reason
            headers[LLMD_DROPPED_REASON_HEADER] = self.dropped_reason
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        return headers


class BadRequestError(GatewayError):
    """The request body or headers are malformed (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class UnprocessableError(BadRequestError):
    """Well-formed JSON whose values cannot be served (422)."""

    status_code = 422


class PayloadTooLargeError(BadRequestError):
    """The body exceeds the configured limit (413)."""

    status_code = 413
    code = "payload_too_large"


class RequestTimeoutError(BadRequestError):
    """The client did not send its body within the body timeout (408)."""

    status_code = 408
    code = "request_timeout"


class AuthenticationError(GatewayError):
    """Missing or wrong API key (401)."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"

    def headers(self) -> Mapping[str, str]:
        return {**super().headers(), "www-authenticate": "Bearer"}


class ModelNotFoundError(GatewayError):
    """No endpoint of the pool serves the requested model (404)."""

    status_code = 404
    error_type = "NotFoundError"
    code = "model_not_found"


class ResponseNotFoundError(GatewayError):
    """A stored response (Responses API) no endpoint of the pool holds any more (404)."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "response_not_found"


class ResponseUnavailableError(GatewayError):
    """The endpoint holding a stored response cannot take requests now (409, retryable)."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "response_endpoint_unavailable"


class NoEndpointsError(GatewayError):
    """The model is known but no endpoint is healthy (503)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "no_endpoints"
    dropped_reason = "rejected-no-endpoints"


class SaturatedError(GatewayError):
    """Flow control shed the request: queues full or sheddable while saturated (429)."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "rejected_saturated"
    dropped_reason = "rejected-saturated"


class TTLExpiredError(SaturatedError):
    """The request waited in a queue longer than its TTL (429)."""

    code = "rejected_ttl_expired"
    dropped_reason = "rejected-ttl-expired"


class SLORejectedError(SaturatedError):
    """A sheddable request whose best predicted time to first token misses its target."""

    dropped_reason = "rejected-slo"


class ShuttingDownError(GatewayError):
    """The gateway is draining for shutdown and gave up on the request (503)."""

    status_code = 503
    error_type = "service_unavailable"
    code = "shutting_down"


class ClientCancelledError(GatewayError):
    """The client went away before the request was dispatched (never rendered to it)."""

    status_code = 499
    error_type = "client_closed_request"
    dropped_reason = "rejected-context-cancelled"


class UpstreamError(GatewayError):
    """Every attempt to reach an endpoint failed before a response started (502)."""

    status_code = 502
    error_type = "upstream_error"
    code = "upstream_unavailable"


class UpstreamTimeoutError(UpstreamError):
    """The endpoint did not answer within the first-byte timeout (504)."""

    status_code = 504
    code = "upstream_timeout"


class ConfigError(Exception):
    """Invalid configuration, raised at start-up; the message names the offending key."""
