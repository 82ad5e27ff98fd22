"""The log writer thread while nothing is logged: it backs off rather than waking 20 times a
second, and goes back to its flush interval as soon as a line was written."""

from __future__ import annotations

import io
import logging
from typing import TextIO, cast

from router.api import logs
from router.api.logs import BatchWriter, DroppingQueueHandler, TextFormatter


class Waits:
    """``BatchWriter``'s stop flag: records each wait's timeout, runs ``on_wait`` with the
    waits so far, and answers "stop" after ``limit`` waits (no thread, no real wait)."""

    def __init__(self, limit: int, queue: DroppingQueueHandler, log_at: set[int]) -> None:
        self.limit, self.queue, self.log_at = limit, queue, log_at
        self.asked: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.asked.append(timeout)
        if len(self.asked) in self.log_at:
            self.queue.emit(logging.LogRecord("t", logging.INFO, "", 0, "line", (), None))
        return len(self.asked) >= self.limit


def test_an_idle_writer_backs_off_and_a_line_brings_back_the_interval() -> None:
    queue = DroppingQueueHandler()
    sink = logging.StreamHandler(cast(TextIO, io.StringIO()))
    sink.setFormatter(TextFormatter())
    writer = BatchWriter(queue, sink, interval=0.05)
    waits = Waits(limit=12, queue=queue, log_at={8})
    writer._stopping = waits  # type: ignore[assignment]
    writer._run()
    idle = logs.IDLE_FLUSH_INTERVAL_S
    assert waits.asked[:5] == [0.05, 0.1, 0.2, 0.4, min(0.8, idle)]  # the old thread: all 0.05
    assert max(waits.asked) == idle <= 0.5
    # A line queued during the 8th wait is written right after it; the interval is back.
    assert waits.asked[8:10] == [0.05, 0.1]
    assert cast(io.StringIO, sink.stream).getvalue().count("line") == 1
