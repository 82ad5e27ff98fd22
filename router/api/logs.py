"""Logging: text or JSON lines, written by a thread so the event loop never waits on stderr.

A slow log consumer (a full pipe, a stalled collector) must not stall the proxy: records go
through a bounded queue to a writer thread, and are dropped (and counted) when it falls behind.
Records are formatted in that thread too, so the loop pays only for the ``logging`` call.

Every request gets one access line on the ``prefixgate.access`` logger with its fields as a
``fields`` mapping: the JSON formatter merges them into the object, the text one appends them as
``key=value`` pairs. Nothing here ever logs a header: keys cannot leak through the access log.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from collections.abc import Callable, Mapping
from logging.handlers import QueueHandler, QueueListener
from typing import Any, Literal, TextIO

import orjson

ACCESS_LOGGER = "prefixgate.access"
LogFormat = Literal["text", "json"]
QUEUE_SIZE = 10_000

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> Mapping[str, Any] | None:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, Mapping) else None


def logfmt(fields: Mapping[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        text = "-" if value is None else str(value)
        if not text or any(c in text for c in ' "=\\') or not text.isprintable():
            text = orjson.dumps(text).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        return f"{line} {logfmt(fields)}" if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
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


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


class DroppingQueueHandler(QueueHandler):
    """Hands records to the writer thread; never blocks, drops when the queue is full."""

    def __init__(self, q: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(q)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # Formatting happens in the writer thread; the stdlib would do it here, on the loop.
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def configure_logging(
    level: str = "info", fmt: LogFormat = "text", stream: TextIO | None = None
) -> Callable[[], None]:
    """Route the root logger through a writer thread; returns the function that stops it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    q: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_SIZE)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(DroppingQueueHandler(q))
    root.setLevel(level.upper())
    listener = QueueListener(q, handler)
    listener.start()
    return listener.stop


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
