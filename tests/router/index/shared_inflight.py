"""A :class:`SharedInFlight` for the tests, closed with the test (the ``closing`` fixture)."""

from __future__ import annotations

from typing import Any

from router.index.redis_state import SharedInFlight


def inflight(
    url: str, namespace: str, closing: list[Any], counts: dict[str, int], **kwargs: Any
) -> SharedInFlight:
    kwargs.setdefault("timeout_ms", 2000.0)  # semantics, not budgets: immune to machine load
    shared = SharedInFlight(url, lambda: counts, namespace=namespace, **kwargs)
    closing.append(shared)
    return shared
