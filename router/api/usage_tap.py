"""The usage tap: what an answer says it cost, read from the relayed bytes.

An answer's ``usage`` is in its JSON body, or in its last SSE events (a Responses stream nests
it in ``response.completed``; a Messages stream counts its prompt only in its first event,
``message_start``). The tap keeps an answer's first and last few KB as they are relayed and,
when the answer ends, hands the usage to the prediction tracker (router/api/prediction.py) and
to one other reader (the index sizer's bytes per token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

from router.api.prediction import PredictionTracker
from router.core.framework import RoutingRequest
from router.core.usage import prompt_tokens, with_prompt_counts
from router.index.response_store import ResponseRoutes

# Another reader of each answer's usage (the index sizer): endpoint, request, usage.
UsageObserver = Callable[[str, RoutingRequest, Mapping[str, Any] | None], None]

# A usage object is a few hundred bytes; past this the scan stops.
_USAGE_OBJECT_BYTES = 4096


def _usage_of(body: Any) -> Mapping[str, Any] | None:
    """The usage of a JSON body or SSE event: at its top, or in the ``message`` (Messages'
    ``message_start``) or ``response`` (Responses' ``response.completed``) it carries."""
    if not isinstance(body, dict):
        return None
    for holder in (body, body.get("response"), body.get("message")):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


def find_usage(data: bytes, *, last: bool = True) -> Mapping[str, Any] | None:
    """The ``usage`` object in a JSON body, or in the last (``last``) or first SSE ``data:``
    event carrying one."""
    text = data.strip()
    if text.startswith(b"{"):
        try:
            return _usage_of(orjson.loads(text))
        except orjson.JSONDecodeError:
            pass  # a tail cut at a brace (mid-event, mid-body): read by lines below
    # Only the lines that name a usage are parsed (splitting a 16 KB tail into lines cost
    # more than the rest of this).
    for line in _usage_lines(text, last):
        found = find_usage(line[5:]) if line.startswith(b"data:") else None
        if found is None:
            # An event cut by the kept tail (a Responses answer repeats its instructions and
            # tools in its last event, tens of KB), or a body longer than the tail.
            found = _usage_object(line)
        if found is not None:
            return found
    return None


def _usage_object(line: bytes) -> Mapping[str, Any] | None:
    """The JSON object after the line's last ``"usage":``, read by matching its braces."""
    at = line.rfind(b'"usage"')
    start = line.find(b"{", at)
    if at < 0 or start < 0 or line[at + 7 : start].strip() != b":":
        return None
    depth, quoted, escaped = 0, False, False
    for end in range(start, min(len(line), start + _USAGE_OBJECT_BYTES)):
        byte = line[end]
        if quoted:
            escaped, quoted = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            quoted = True
        elif byte in b"{}":
            depth += 1 if byte == 0x7B else -1
            if depth == 0:
                try:
                    usage = orjson.loads(line[start : end + 1])
                except orjson.JSONDecodeError:
                    return None
                return usage if isinstance(usage, dict) else None
    return None


def _usage_lines(text: bytes, last: bool) -> Iterator[bytes]:
    """The lines of ``text`` that name a ``"usage"``, from the end (``last``) or the start."""
    start, end = 0, len(text)
    while True:
        at = text.rfind(b'"usage"', start, end) if last else text.find(b'"usage"', start, end)
        if at < 0:
            return
        begin = text.rfind(b"\n", 0, at) + 1
        stop = text.find(b"\n", at)
        stop = stop if stop >= 0 else len(text)
        yield text[begin:stop]
        if last:
            end = begin
        else:
            start = stop


class UsageTap:
    """Keeps the tail of a relayed answer, where its ``usage`` is (the non-streaming body, or
    the last SSE events), and its first chunk, and hands the usage to the tracker when the
    answer ends. A Messages stream ends on a usage of output tokens only: its prompt's count
    is in the first event (``message_start``), so that one's is read too where the last has
    none."""

    __slots__ = (
        "_also", "_endpoint_id", "_first", "_first_size", "_parts", "_routing", "_size",
        "_tracker",
    )
    TAIL_BYTES = 16384
    FIRST_BYTES = 8192

    def __init__(
        self,
        tracker: PredictionTracker,
        endpoint_id: str,
        routing: RoutingRequest,
        also: UsageObserver | None = None,
    ) -> None:
        self._tracker = tracker
        self._also = also
        self._endpoint_id = endpoint_id
        self._routing = routing
        self._parts: list[bytes] = []
        self._size = 0
        self._first: list[bytes] = []  # the answer's first FIRST_BYTES, however chunked
        self._first_size = 0

    def __call__(self, chunk: bytes) -> None:
        # Called for every relayed chunk: append, and cut back to the tail only once twice
        # its size has piled up (copying the tail on every token cost more than relaying it).
        if self._first_size < self.FIRST_BYTES:
            self._first.append(chunk[: self.FIRST_BYTES - self._first_size])
            self._first_size += len(self._first[-1])
        self._parts.append(chunk)
        self._size += len(chunk)
        if self._size > 2 * self.TAIL_BYTES:
            tail = self.tail()
            self._parts, self._size = [tail], len(tail)

    def tail(self) -> bytes:
        """The last ``TAIL_BYTES`` relayed."""
        return b"".join(self._parts)[-self.TAIL_BYTES :]

    def usage(self) -> Mapping[str, Any] | None:
        """The answer's usage: the last one it carries, completed by its first event's where
        the last counts no prompt tokens."""
        usage = find_usage(self.tail())
        if self._first and prompt_tokens(usage) is None:
            early = find_usage(b"".join(self._first), last=False)
            if early is not None:
                usage = with_prompt_counts(usage, early)
        return usage

    def finish(self) -> None:
        usage = self.usage()
        self._tracker.observe(self._endpoint_id, self._routing, usage)
        if self._also is not None:
            self._also(self._endpoint_id, self._routing, usage)


def answer_taps(
    status: int,
    endpoint_id: str,
    routing: RoutingRequest,
    tracker: PredictionTracker | None,
    also: UsageObserver | None,
    stores: ResponseRoutes | None,
) -> tuple[Callable[[bytes], None] | None, UsageTap | None]:
    """What reads a relayed answer: its usage (how right the prefix index was, and ``also``:
    what a token weighs) and, for the Responses API (``stores``), which endpoint keeps it; the
    chunk tap and the usage tap to finish when the answer ends."""
    if status != 200:
        return None, None
    usage = None
    if tracker is not None and tracker.sampled(routing):
        usage = UsageTap(tracker, endpoint_id, routing, also)
    stored = None
    if stores is not None and routing.stores_response:  # ``store: false``: kept nowhere
        stored = stores.tap(endpoint_id)
    if stored is None or usage is None:
        return (stored or usage), usage

    def both(chunk: bytes) -> None:
        usage(chunk)
        stored(chunk)

    return both, usage
