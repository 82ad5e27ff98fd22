"""One request's record as it passes the gateway: what the access log and metrics report."""

from __future__ import annotations

from dataclasses import dataclass

from router.parsing import Api


@dataclass(slots=True)
class Exchange:
    """What the access log and metrics say of one request; filled in as it goes."""

    api: Api
    request_id: str
    started: float
    status: int = 0
    outcome: str = "ok"
    endpoint: str | None = None
    model: str | None = None
    stream: bool | None = None
    tenant: str | None = None
    attempts: int = 0
    ttfb: float | None = None
    prefix_match: float | None = None

    def fields(self, finished: float) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "api": self.api,
            "model": self.model,
            "stream": self.stream,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "status": self.status,
            "outcome": self.outcome,
            "attempts": self.attempts,
            "ttfb_ms": None if self.ttfb is None else round(self.ttfb * 1000, 2),
            "duration_ms": round((finished - self.started) * 1000, 2),
            "prefix_match": None if self.prefix_match is None else round(self.prefix_match, 3),
        }
