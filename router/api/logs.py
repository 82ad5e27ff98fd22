"""Logging: text or JSON lines, written by a thread so the event loop never waits on stderr.

A slow log consumer (a full pipe, a stalled collector) must not stall the proxy: records go
through a bounded queue to a writer thread, and are dropped (and counted) when it falls behind.
Records are formatted in that thread too, so the loop pays only for the ``logging`` call. The
thread wakes every ``FLUSH_INTERVAL_S`` and writes what came meanwhile in one call: woken per
record (a queue's notify, a thread switch, the GIL handed over and back, a write and a flush
per line), it cost the process more CPU than the rest of the access log.

Every request gets one access line on the ``prefixgate.access`` logger with its fields: the
JSON formatter merges them into the object, the text one appends them as ``key=value`` pairs
(router/api/logfmt.py).
When logging would hand that line to the writer's queue alone (as ``configure_logging`` sets
it up), the loop skips ``logging`` and queues a tuple: a ``LogRecord`` (the clock, the pid, the
thread's and process's names) and the handlers' locks cost more than the rest of the request's
logging, and the writer formats the tuple straight into the same line. Nothing here ever logs
a header: keys cannot leak through the access log.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TextIO

import orjson
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from router.api.logfmt import Words, access_logfmt, logfmt
from router.protocol.exchange import Exchange, ExchangeFields

ACCESS_LOGGER = "prefixgate.access"
LogFormat = Literal["text", "json"]
QUEUE_SIZE = 10_000
FLUSH_INTERVAL_S = 0.05
# With nothing to write, the writer doubles its wait up to this: an idle gateway's thread woke
# 20 times a second for nothing (a sixth of its idle CPU); the first line after a quiet spell
# is written within this, and the flush interval is back as soon as a line was.
IDLE_FLUSH_INTERVAL_S = 0.4

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A request's access line as queued by the loop: its exchange, the perf_counter when it
# finished, and the wall-clock time (a record's ``created``).
AccessEntry = tuple[Exchange, float, float]
Queued = logging.LogRecord | AccessEntry


def _fields(record: logging.LogRecord) -> Mapping[str, Any] | None:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, Mapping) else None


class Stamps:
    """A time's text to the second, made once a second rather than once a line (the writer
    formats a line per request)."""

    __slots__ = ("_convert", "_format", "_last")

    def __init__(self, fmt: str, convert: Callable[[float], time.struct_time]) -> None:
        self._format = fmt
        self._convert = convert
        self._last: tuple[int, str] = (-1, "")

    def __call__(self, created: float) -> str:
        second = int(created)
        last = self._last
        if last[0] != second:
            last = (second, time.strftime(self._format, self._convert(created)))
            self._last = last
        return last[1]


class AccessFormatter(logging.Formatter):
    """A formatter that also writes a queued access entry's line, with no ``LogRecord``: the
    same line as ``format`` gives the record ``AccessLog.emit`` makes."""

    def access_line(self, ex: Exchange, finished: float, created: float) -> str:
        raise NotImplementedError


class TextFormatter(AccessFormatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)
        self._stamps = Stamps(self.default_time_format, self.converter)
        self._words = Words()

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or not self.default_msec_format:
            return super().formatTime(record, datefmt)
        return self.default_msec_format % (self._stamps(record.created), record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        return f"{line} {logfmt(fields)}" if fields else line

    def access_line(self, ex: Exchange, finished: float, created: float) -> str:
        # What _TEXT_FORMAT makes of the record, msecs computed as LogRecord does.
        stamp = self._stamps(created)
        msecs = int((created - int(created)) * 1000)
        fields = access_logfmt(ex, finished, self._words)
        return f"{stamp},{msecs:03d} INFO {ACCESS_LOGGER}: request {fields}"


class JsonFormatter(AccessFormatter):
    """One JSON object per line: ts, level, logger, msg, then the record's ``fields``."""

    def __init__(self) -> None:
        super().__init__()
        self._stamps = Stamps("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def _ts(self, created: float) -> str:
        return f"{self._stamps(created)}.{int(created % 1 * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._ts(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = _fields(record)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()

    def access_line(self, ex: Exchange, finished: float, created: float) -> str:
        out: dict[str, Any] = {
            "ts": self._ts(created), "level": "info", "logger": ACCESS_LOGGER, "msg": "request"
        }
        out.update(ex.fields(finished))
        return orjson.dumps(out, default=str).decode()


def access_record(entry: AccessEntry) -> logging.LogRecord:
    """The record ``AccessLog.emit`` would have made for a queued entry (for a formatter that
    does not write entries itself, and for reporting an error)."""
    ex, finished, created = entry
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, "", 0, "request", (), None)
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    record.fields = ExchangeFields(ex, finished)
    return record


def _as_record(item: Queued) -> logging.LogRecord:
    return item if isinstance(item, logging.LogRecord) else access_record(item)


class DroppingQueueHandler(logging.Handler):
    """Hands records (and access entries) to the writer thread: an append to a deque, which
    needs no lock and wakes nobody; drops (and counts) one when ``capacity`` of them wait."""

    def __init__(self, capacity: int = QUEUE_SIZE) -> None:
        super().__init__()
        self._queued: deque[Queued] = deque()
        self._capacity = capacity
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        # Not formatted here: that happens in the writer thread, off the event loop.
        self.put(record)

    def put(self, item: Queued) -> None:
        if len(self._queued) >= self._capacity:
            self.dropped += 1
        else:
            self._queued.append(item)

    def take(self) -> list[Queued]:
        """Every record waiting, oldest first."""
        pop = self._queued.popleft
        # Only this thread pops: the length read is a floor of what can be taken.
        return [pop() for _ in range(len(self._queued))]


class LogDrops(Collector):
    """``prefixgate_log_lines_dropped_total``: the lines (access lines included) dropped
    because the writer thread fell behind, read at scrape time from the root logger's queue
    (whichever :func:`configure_logging` installed)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger()

    def collect(self) -> Iterator[Metric]:
        dropped = sum(
            h.dropped for h in self._logger.handlers if isinstance(h, DroppingQueueHandler)
        )
        yield CounterMetricFamily(
            "prefixgate_log_lines_dropped",
            "Log and access lines dropped because the log writer fell behind.",
            value=dropped,
        )


# How long a stop waits for a write in progress.
STOP_TIMEOUT_S = 5.0


class BatchWriter:
    """The writer thread: every ``interval`` seconds it formats the records waiting in
    ``source`` with ``sink``'s formatter and writes them to ``sink``'s stream in one call."""

    def __init__(
        self,
        source: DroppingQueueHandler,
        sink: logging.StreamHandler[TextIO],
        interval: float = FLUSH_INTERVAL_S,
        stop_timeout: float = STOP_TIMEOUT_S,
    ) -> None:
        self._source = source
        self._sink = sink
        self._interval = interval
        self._stop_timeout = stop_timeout
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixgate-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is left and end the thread; a sink that blocks (a stalled stderr pipe)
        past the stop timeout keeps what is left, rather than holding the process's exit."""
        self._stopping.set()
        self._thread.join(self._stop_timeout)
        if not self._thread.is_alive():
            self.flush()

    def _run(self) -> None:
        wait, longest = self._interval, max(self._interval, IDLE_FLUSH_INTERVAL_S)
        while not self._stopping.wait(wait):
            wait = self._interval if self.flush() else min(2 * wait, longest)

    def flush(self) -> bool:
        """Write what waits; False when nothing did."""
        items = self._source.take()
        if items:
            self._write(items)
        return bool(items)

    def _line(self, item: Queued) -> str:
        if isinstance(item, logging.LogRecord):
            return self._sink.format(item)
        formatter = self._sink.formatter
        if isinstance(formatter, AccessFormatter):
            return formatter.access_line(*item)
        return self._sink.format(access_record(item))

    def _write(self, items: list[Queued]) -> None:
        sink = self._sink
        lines = []
        for item in items:
            try:
                lines.append(self._line(item) + sink.terminator)
            except Exception:
                sink.handleError(_as_record(item))
        sink.acquire()
        try:
            sink.stream.write("".join(lines))
            sink.flush()
        except Exception:
            sink.handleError(_as_record(items[-1]))
        finally:
            sink.release()


def make_formatter(fmt: LogFormat) -> AccessFormatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def configure_logging(
    level: str = "info", fmt: LogFormat = "text", stream: TextIO | None = None
) -> Callable[[], None]:
    """Route the root logger through a writer thread; returns the function that stops it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    source = DroppingQueueHandler()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(source)
    root.setLevel(level.upper())
    writer = BatchWriter(source, handler)
    writer.start()
    return writer.stop


class AccessLog:
    """One line per request, or per sampled request; costs one level check when off.

    With ``sample_rate`` below 1, successful requests are logged one in 1/rate (a running
    credit, so the share is exact and no random number is drawn); failures always are.
    """

    def __init__(self, enabled: bool = True, sample_rate: float = 1.0) -> None:
        self._log = logging.getLogger(ACCESS_LOGGER)
        self._enabled = enabled
        self._rate = sample_rate
        self._credit = 0.0

    @property
    def active(self) -> bool:
        return self._enabled and self._log.isEnabledFor(logging.INFO)

    def sampled(self, failed: bool) -> bool:
        """Whether this request's line is written (call once per request, when active)."""
        if failed or self._rate >= 1.0:
            return True
        self._credit += self._rate
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        return True

    def record(self, ex: Exchange, finished: float) -> None:
        """The exchange's line (call when ``active``): queued as a tuple for the writer when
        logging would hand it to the writer's queue and nothing else, else through ``emit``."""
        queue = self._sole_queue()
        if queue is not None:
            queue.put((ex, finished, time.time()))
        else:
            self.emit(ExchangeFields(ex, finished))

    def emit(self, fields: Mapping[str, Any]) -> None:
        """A line with these fields, through ``logging``. The record is made directly (no
        caller lookup, which walks the stack); ``fields`` may be lazy, built when formatted."""
        log = self._log
        record = log.makeRecord(
            log.name, logging.INFO, "", 0, "request", (), None, extra={"fields": fields}
        )
        log.handle(record)

    def _sole_queue(self) -> DroppingQueueHandler | None:
        """The queue ``logging`` would give this logger's INFO records to, when it is the only
        handler they would reach and no filter would see them; looked up per line (cheap: the
        logger and root), since handlers come and go (tests capture logs by adding one)."""
        logger: logging.Logger | None = self._log
        if self._log.filters:
            return None
        found: DroppingQueueHandler | None = None
        while logger is not None:
            for handler in logger.handlers:
                if handler.level > logging.INFO:
                    continue
                if found is not None or type(handler) is not DroppingQueueHandler:
                    return None
                if handler.filters:
                    return None
                found = handler
            if not logger.propagate:
                break
            logger = logger.parent
        return found
