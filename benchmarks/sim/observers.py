"""What an engine reports to: its KV events and its requests' latencies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .kv_events import KVEvent


class KVEventSink(Protocol):
    """Receives each step's KV events (the ZMQ publisher implements it)."""

    def publish(self, events: Sequence[KVEvent]) -> None: ...


class LatencyObserver(Protocol):
    """Receives per-request latencies in simulated seconds (the metrics module implements it)."""

    def on_queued(self, seconds: float) -> None: ...

    def on_first_token(self, seconds: float) -> None: ...

    def on_token(self, seconds: float) -> None: ...

    def on_finished(self, seconds: float) -> None: ...


@dataclass
class EngineStats:
    """Monotonic counters of one engine."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_succeeded: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    steps: int = 0
