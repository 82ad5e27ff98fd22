from __future__ import annotations

import logging

import orjson
import pytest

from router.api.logs import ACCESS_LOGGER, AccessLog, JsonFormatter
from router.protocol.exchange import Exchange, ExchangeFields


def test_sampling_logs_the_exact_share_of_successes_and_every_failure() -> None:
    log = AccessLog(sample_rate=0.25)
    successes = [log.sampled(failed=False) for _ in range(100)]
    assert sum(successes) == 25
    assert successes[:4] == [False, False, False, True], "deterministic, one in four"
    assert all(log.sampled(failed=True) for _ in range(10))
    assert all(AccessLog().sampled(failed=False) for _ in range(10))


def test_a_line_is_built_from_the_exchange_when_formatted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    ex = Exchange("chat", "rid-1", started=10.0, status=200, endpoint="e1")
    fields = ExchangeFields(ex, finished=10.5)
    AccessLog().emit(fields)
    [record] = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    line = orjson.loads(JsonFormatter().format(record))
    assert (line["request_id"], line["status"], line["duration_ms"]) == ("rid-1", 200, 500.0)
    assert dict(fields) == ex.fields(10.5)
