"""One request's record as it passes the gateway: what the access log and metrics report."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from router.protocol.parsing import Api


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


class ExchangeFields(Mapping[str, object]):
    """An exchange's access-log fields, built when first read: by the log's writer thread,
    off the event loop (the exchange is finished and no longer changes by then)."""

    __slots__ = ("_exchange", "_fields", "_finished")

    def __init__(self, exchange: Exchange, finished: float) -> None:
        self._exchange = exchange
        self._finished = finished
        self._fields: dict[str, object] | None = None

    def _built(self) -> dict[str, object]:
        if self._fields is None:
            self._fields = self._exchange.fields(self._finished)
        return self._fields

    def __getitem__(self, key: str) -> object:
        return self._built()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())
