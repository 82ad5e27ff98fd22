"""A gateway config for tests: the simulated replicas' model, fast health checks and scrapes."""

from __future__ import annotations

import threading
from typing import Any

from router.config.model import parse_config
from router.estimators.calibration import Calibrator

MODEL = "sim-model"


def gateway_config(urls: list[str], speed_probe: bool = False, **overrides: Any) -> Any:
    """``speed_probe``: off unless asked for, since tests count the requests replicas get."""
    data: dict[str, Any] = {
        "server": {"port": 0},
        "pool": {
            "endpoints": [{"url": u} for u in urls],
            "healthCheck": {"intervalSeconds": 0.2, "unhealthyThreshold": 2},
            "metricsScrape": {"intervalSeconds": 0.05},
            "speedProbe": {"enabled": speed_probe},
        },
        "seed": 1,
    }
    data.update(overrides)
    return parse_config(data)


class Parses(list[tuple[int, threading.Thread]]):
    """Every request body routing parsed: its size and the thread it was parsed on."""

    @property
    def sizes(self) -> list[int]:
        return [size for size, _ in self]

    @property
    def threads(self) -> list[threading.Thread]:
        return [thread for _, thread in self]


def learned_first_tokens(calibrator: Calibrator) -> list[float]:
    """The times to first token ``calibrator`` learns from here on (it learns them too)."""
    learned: list[float] = []
    observe = calibrator.observe

    def spy(endpoint_id: str, tokens: float, seconds: float, *rest: float) -> None:
        learned.append(seconds)
        observe(endpoint_id, tokens, seconds, *rest)

    calibrator.observe = spy  # type: ignore[method-assign]
    return learned
