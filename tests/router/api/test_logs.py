from __future__ import annotations

import contextlib
import io
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import TextIO, cast

import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.api.logfmt import logfmt
from router.api.logs import (
    ACCESS_LOGGER,
    AccessLog,
    BatchWriter,
    DroppingQueueHandler,
    JsonFormatter,
    LogDrops,
    LogFormat,
    TextFormatter,
    make_formatter,
)
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


CREATED = 1_764_678_000.987654  # a record's wall-clock time, fixed


def variants() -> Iterator[Exchange]:
    """Exchanges with every field's kinds of value: unset, plain, and needing quotes."""
    for model, tenant, ttfb, share, stream in itertools.product(
        [None, "m-1", "two words", 'q"uote', "", "x\ny", "café"],
        [None, "team=a"],
        [None, 0.01234],
        [None, 0.87654],
        [None, True, False],
    ):
        yield Exchange(
            "chat", "rid-1", started=10.0, status=200, endpoint="127.0.0.1:8001", model=model,
            tenant=tenant, ttfb=ttfb, prefix_match=share, stream=stream, attempts=1,
        )


def emitted(ex: Exchange, finished: float) -> logging.LogRecord:
    """The record AccessLog.emit makes for an exchange, at CREATED."""
    log = logging.getLogger(ACCESS_LOGGER)
    fields = ExchangeFields(ex, finished)
    record = log.makeRecord(
        log.name, logging.INFO, "", 0, "request", (), None, extra={"fields": fields}
    )
    record.created, record.msecs = CREATED, 987.0
    return record


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_queued_entry_is_written_as_the_same_line_as_its_record(fmt: LogFormat) -> None:
    formatter = make_formatter(fmt)
    for ex in variants():
        assert formatter.access_line(ex, 10.5, CREATED) == formatter.format(emitted(ex, 10.5))


@contextlib.contextmanager
def queue_only() -> Iterator[DroppingQueueHandler]:
    """The root logger's only handler is a queue (as configure_logging leaves it); restored
    afterwards, pytest's capture handlers (added when the test runs) included."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    queue = DroppingQueueHandler(capacity=3)
    for handler in saved[0]:
        root.removeHandler(handler)
    root.addHandler(queue)
    root.setLevel(logging.INFO)
    try:
        yield queue
    finally:
        root.removeHandler(queue)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])


def text_sink() -> tuple[io.StringIO, logging.StreamHandler[TextIO]]:
    stream = io.StringIO()
    sink = logging.StreamHandler(cast(TextIO, stream))
    sink.setFormatter(TextFormatter())
    return stream, sink


def test_the_loop_queues_a_tuple_and_the_writer_writes_its_line() -> None:
    ex = Exchange("chat", "rid-1", started=10.0, status=200, endpoint="e1")
    stream, sink = text_sink()
    with queue_only() as queue:
        AccessLog().record(ex, 10.5)
        logging.getLogger("other").info("after")
        [entry, other] = queued = queue.take()
        for item in queued:
            queue.put(item)
        BatchWriter(queue, sink).flush()
    assert isinstance(entry, tuple) and entry[:2] == (ex, 10.5)
    assert isinstance(other, logging.LogRecord)
    first, second = stream.getvalue().splitlines()
    assert first.endswith(f"INFO {ACCESS_LOGGER}: request {logfmt(ex.fields(10.5))}")
    assert second.endswith("INFO other: after")


def test_entries_beyond_the_queue_capacity_are_dropped_and_counted() -> None:
    log = AccessLog()
    with queue_only() as queue:
        for n in range(5):
            log.record(Exchange("chat", f"r{n}", 0.0), 1.0)
    assert queue.dropped == 2
    taken = queue.take()
    assert [item[0].request_id for item in taken if isinstance(item, tuple)] == ["r0", "r1", "r2"]


def test_a_writer_whose_formatter_knows_no_entries_formats_their_records() -> None:
    class Plain(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.name} {record.getMessage()} {dict(record.__dict__['fields'])}"

    ex = Exchange("chat", "rid-1", 10.0, status=200)
    stream, sink = text_sink()
    sink.setFormatter(Plain())
    with queue_only() as queue:
        AccessLog().record(ex, 10.5)
        BatchWriter(queue, sink).flush()
    assert stream.getvalue() == f"{ACCESS_LOGGER} request {ex.fields(10.5)}\n"


def test_another_handler_or_a_filter_gets_the_line_through_logging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = AccessLog()
    access = logging.getLogger(ACCESS_LOGGER)
    seen: list[str] = []

    def drop(record: logging.LogRecord) -> bool:
        seen.append(record.__dict__["fields"]["request_id"])
        return False

    with queue_only() as queue:
        logging.getLogger().addHandler(caplog.handler)
        log.record(Exchange("chat", "rid-1", 10.0), 10.5)
        logging.getLogger().removeHandler(caplog.handler)
        [through_logging] = queue.take()
        access.addFilter(drop)
        try:
            log.record(Exchange("chat", "rid-2", 10.0), 10.5)
        finally:
            access.removeFilter(drop)
        assert queue.take() == []
    [record] = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert record.__dict__["fields"]["request_id"] == "rid-1" and through_logging is record
    assert seen == ["rid-2"]


def test_a_stop_does_not_wait_for_good_on_a_sink_that_blocks() -> None:
    """A stalled stderr pipe blocks the writer thread's write: a stop gives up on what is left
    after its timeout rather than holding the process's exit."""
    entered, release = threading.Event(), threading.Event()

    class Stalled(io.StringIO):
        def write(self, text: str) -> int:
            entered.set()
            release.wait(30)  # bounded: released below either way
            return len(text)

    sink = logging.StreamHandler(cast(TextIO, Stalled()))
    sink.setFormatter(TextFormatter())
    queue = DroppingQueueHandler(capacity=10)
    queue.put(logging.LogRecord("other", logging.INFO, __file__, 1, "stuck", None, None))
    writer = BatchWriter(queue, sink, interval=0.001, stop_timeout=0.05)
    writer.start()
    assert entered.wait(10), "the writer thread never wrote"
    stopper = threading.Thread(target=writer.stop)
    stopper.start()
    stopper.join(10)
    try:
        assert not stopper.is_alive(), "stop() waited on the blocked sink"
    finally:
        release.set()
        stopper.join(10)


def test_dropped_lines_are_exported_as_a_counter() -> None:
    logger = logging.getLogger("prefixgate.test-drops")
    queue = DroppingQueueHandler(capacity=2)
    logger.addHandler(queue)
    registry = CollectorRegistry()
    registry.register(LogDrops(logger))
    try:
        assert registry.get_sample_value("prefixgate_log_lines_dropped_total") == 0
        for n in range(5):
            logger.warning("line %d", n)
        assert registry.get_sample_value("prefixgate_log_lines_dropped_total") == 3
    finally:
        logger.removeHandler(queue)
