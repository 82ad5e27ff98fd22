"""Logging: text or JSON lines, written by a thread so the event loop never waits on stderr.

A slow log consumer (a full pipe, a stalled collector) must not stall the proxy: records go
through a bounded queue to a writer thread, and are dropped (and counted) when it falls behind.
Records are formatted in that thread too, so the loop pays only for the ``logging`` call. The
thread wakes every ``FLUSH_INTERVAL_S`` and writes what came meanwhile in one call: woken per
record (a queue's notify, a thread switch, the GIL handed over and back, a write and a flush
per line), it cost the process more CPU than the rest of the access log.

Every request gets one access line on the ``prefixgate.access`` logger with its fields as a
``fields`` mapping: the JSON formatter merges them into the object, the text one appends them as
``key=value`` pairs. Nothing here ever logs a header: keys cannot leak through the access log.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal, TextIO

import orjson

ACCESS_LOGGER = "prefixgate.access"
LogFormat = Literal["text", "json"]
QUEUE_SIZE = 10_000
FLUSH_INTERVAL_S = 0.05

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A logfmt value with one of these (or empty, or unprintable) is quoted.
_QUOTED = re.compile(r'[ "=\\]')
_NUMBERS = frozenset({int, float, bool})


def _fields(record: logging.LogRecord) -> Mapping[str, Any] | None:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, Mapping) else None


def logfmt(fields: Mapping[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if value is None:
            text = "-"
        elif type(value) in _NUMBERS:
            text = str(value)  # never quoted: skip the checks
        else:
            text = str(value)
            if not text or _QUOTED.search(text) or not text.isprintable():
                text = orjson.dumps(text).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


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


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)
        self._stamps = Stamps(self.default_time_format, self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or not self.default_msec_format:
            return super().formatTime(record, datefmt)
        return self.default_msec_format % (self._stamps(record.created), record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        return f"{line} {logfmt(fields)}" if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's ``fields``."""

    def __init__(self) -> None:
        super().__init__()
        self._stamps = Stamps("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": f"{self._stamps(record.created)}.{int(record.created % 1 * 1000):03d}Z",
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


class DroppingQueueHandler(logging.Handler):
    """Hands records to the writer thread: an append to a deque, which needs no lock and wakes
    nobody; drops (and counts) a record when ``capacity`` of them wait."""

    def __init__(self, capacity: int = QUEUE_SIZE) -> None:
        super().__init__()
        self._records: deque[logging.LogRecord] = deque()
        self._capacity = capacity
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        # Not formatted here: that happens in the writer thread, off the event loop.
        if len(self._records) >= self._capacity:
            self.dropped += 1
        else:
            self._records.append(record)

    def take(self) -> list[logging.LogRecord]:
        """Every record waiting, oldest first."""
        records: list[logging.LogRecord] = []
        pop = self._records.popleft
        while True:
            try:
                records.append(pop())
            except IndexError:
                return records


class BatchWriter:
    """The writer thread: every ``interval`` seconds it formats the records waiting in
    ``source`` with ``sink``'s formatter and writes them to ``sink``'s stream in one call."""

    def __init__(
        self,
        source: DroppingQueueHandler,
        sink: logging.StreamHandler[TextIO],
        interval: float = FLUSH_INTERVAL_S,
    ) -> None:
        self._source = source
        self._sink = sink
        self._interval = interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixgate-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is left and end the thread."""
        self._stopping.set()
        self._thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.flush()

    def flush(self) -> None:
        records = self._source.take()
        if records:
            self._write(records)

    def _write(self, records: list[logging.LogRecord]) -> None:
        sink = self._sink
        lines = []
        for record in records:
            try:
                lines.append(sink.format(record) + sink.terminator)
            except Exception:
                sink.handleError(record)
        sink.acquire()
        try:
            sink.stream.write("".join(lines))
            sink.flush()
        except Exception:
            sink.handleError(records[-1])
        finally:
            sink.release()


def make_formatter(fmt: LogFormat) -> logging.Formatter:
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

    The line's record is made directly (no caller lookup, which walks the stack) and its
    ``fields`` may be a lazy mapping, so building the line's text falls to the writer thread.
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

    def emit(self, fields: Mapping[str, Any]) -> None:
        log = self._log
        record = log.makeRecord(
            log.name, logging.INFO, "", 0, "request", (), None, extra={"fields": fields}
        )
        log.handle(record)
