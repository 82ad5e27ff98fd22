"""The usage tap: what it keeps of a relayed answer, and the usage it hands over."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from router.api.prediction import PredictionTracker
from router.api.usage_tap import UsageTap, answer_taps, find_usage
from router.core.framework import RoutingRequest
from router.core.sampling import RateSampler
from router.core.usage import cached_tokens, prompt_tokens
from tests.manual_clock import ManualClock


class Recorder(PredictionTracker):
    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.seen: list[tuple[str, Mapping[str, Any] | None]] = []

    def observe(
        self, endpoint_id: str, routing: RoutingRequest, usage: Mapping[str, Any] | None
    ) -> None:
        self.seen.append((endpoint_id, usage))


def test_a_long_stream_keeps_its_tail_and_hands_over_the_final_usage() -> None:
    tracker = Recorder()
    tap = UsageTap(tracker, "e1", RoutingRequest("r", "m"))
    events = [b'data: {"choices": [{"delta": {"content": "tok%d"}}]}\n\n' % i for i in range(3000)]
    usage = {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 512}}
    events.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    for event in events:
        tap(event)
    whole = b"".join(events)
    assert len(whole) > 4 * UsageTap.TAIL_BYTES
    assert tap.tail() == whole[-UsageTap.TAIL_BYTES :]
    tap.finish()
    assert tracker.seen == [("e1", usage)]


def test_a_short_body_is_kept_whole() -> None:
    tracker = Recorder()
    tap = UsageTap(tracker, "e2", RoutingRequest("r", "m"))
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3}})
    tap(body[:10])
    tap(body[10:])
    assert tap.tail() == body and find_usage(tap.tail()) == {"prompt_tokens": 3}
    tap.finish()
    assert tracker.seen == [("e2", {"prompt_tokens": 3})]


def test_find_usage_takes_the_last_event_naming_a_usage_in_a_stream() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 2}
    first = {"choices": [{"text": 'say "usage" twice'}], "usage": None}
    last = {"choices": [], "usage": usage}
    stream = (
        b"data: " + orjson.dumps(first) + b"\r\n\r\n"
        + b"data: " + orjson.dumps(last) + b"\r\n\r\n"
        + b"data: " + orjson.dumps({"choices": [], "usage": None}) + b"\n\n"
        + b": a comment naming \"usage\"\n\n"
        + b"data: [DONE]\n\n"
    )
    assert find_usage(stream) == usage
    assert find_usage(b"data: " + orjson.dumps(first) + b"\n\ndata: [DONE]\n\n") is None
    assert find_usage(b'data: {"usage": {"prompt_tokens": 1}}') == {"prompt_tokens": 1}
    assert find_usage(b'data: {"usage": broken\n\n') is None


def test_find_usage_reads_the_usage_an_event_nests() -> None:
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 9}}}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 2}}
    assert find_usage(b"event: x\ndata: " + orjson.dumps(completed) + b"\n\n") == {
        "input_tokens": 9
    }
    messages = b"".join(
        b"event: e\ndata: " + orjson.dumps(event) + b"\n\n"
        for event in (start, {"type": "ping"}, delta, {"type": "message_stop"})
    )
    assert find_usage(messages) == {"output_tokens": 2}
    assert find_usage(messages, last=False) == {"input_tokens": 5}


def _messages_stream(text_events: int) -> list[bytes]:
    usage = {
        "input_tokens": 4, "output_tokens": 1, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 96,
    }
    start = {"type": "message_start", "message": {"content": [], "usage": usage}}
    deltas = [
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": f"w{i}"}}
        for i in range(text_events)
    ]
    end = {"type": "message_delta", "delta": {}, "usage": {"output_tokens": text_events}}
    return [
        b"event: e\ndata: " + orjson.dumps(event) + b"\n\n"
        for event in (start, *deltas, end, {"type": "message_stop"})
    ]


def test_a_messages_stream_hands_over_its_first_events_prompt_count() -> None:
    """The last usage of a Messages stream counts output tokens only; the prompt's count is
    in message_start, which a long answer pushes out of the kept tail, and which may come in
    pieces."""
    for text_events, size in ((3, 1 << 20), (3000, 1 << 20), (3, 10)):
        tracker = Recorder()
        tap = UsageTap(tracker, "e", RoutingRequest("r", "m"))
        whole = b"".join(_messages_stream(text_events))
        for at in range(0, len(whole), size):
            tap(whole[at : at + size])
        tap.finish()
        [(_, usage)] = tracker.seen
        assert usage is not None
        assert usage["output_tokens"] == text_events
        assert prompt_tokens(usage) == 100 and cached_tokens(usage) == 96


def test_a_zero_filled_prompt_count_in_the_last_event_does_not_hide_the_first() -> None:
    tracker = Recorder()
    tap = UsageTap(tracker, "e", RoutingRequest("r", "m"))
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 4,
             "cache_read_input_tokens": 96}}}
    delta = {"type": "message_delta", "usage": {"input_tokens": 0, "output_tokens": 7}}
    for event in (start, delta):
        tap(b"event: e\ndata: " + orjson.dumps(event) + b"\n\n")
    tap.finish()
    [(_, usage)] = tracker.seen
    assert prompt_tokens(usage) == 100 and usage is not None and usage["output_tokens"] == 7


def test_the_usage_of_an_event_longer_than_the_kept_tail_is_still_found() -> None:
    """A Responses stream's last event repeats the instructions and tools: tens of KB, cut
    where the kept tail starts."""
    usage = {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 512}}
    response = {"instructions": "be {careful} \" " * 4000, "output": [], "usage": usage}
    event = {"type": "response.completed", "response": response}
    stream = b"event: response.completed\ndata: " + orjson.dumps(event) + b"\n\n"
    assert len(stream) > 2 * UsageTap.TAIL_BYTES
    tracker = Recorder()
    tap = UsageTap(tracker, "e", RoutingRequest("r", "m"))
    for at in range(0, len(stream), 4096):
        tap(stream[at : at + 4096])
    tap.finish()
    assert tracker.seen == [("e", usage)]
    body = orjson.dumps(response)  # not streamed, and longer than the tail
    assert find_usage(body[-UsageTap.TAIL_BYTES :]) == usage
    assert find_usage(b'..."usage": null, "x": {"a": 1}}') is None


class Finishes:
    """Precise routing's state table, as far as the tracker uses it."""

    def __init__(self) -> None:
        self.finished: list[int] = []

    def finish(self, serial: int) -> None:
        self.finished.append(serial)


def test_answers_beyond_the_sampling_rate_are_not_read() -> None:
    clock = ManualClock()
    precise = Finishes()
    tracker = PredictionTracker(
        CollectorRegistry(), precise=precise, sampler=RateSampler(2.0, 2.0, clock)
    )
    body = orjson.dumps(
        {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 0}}}
    )
    taps = []
    for n in range(4):
        chunk_tap, usage_tap = answer_taps(
            200, "e1", RoutingRequest(f"r{n}", "m", serial=n), tracker, None, None
        )
        assert chunk_tap is usage_tap
        taps.append(usage_tap)
    assert [t is not None for t in taps] == [True, True, False, False]
    # The two left out are done with: precise routing's state for them is dropped at once.
    assert precise.finished == [2, 3]
    assert tracker.skips == {"sampled_out": 2}
    clock.now += 0.5  # one answer's worth at 2 a second
    assert answer_taps(200, "e1", RoutingRequest("r4", "m"), tracker, None, None)[1] is not None
    for tap in taps[:2]:
        assert tap is not None
        tap(body)
        tap.finish()
    assert precise.finished == [2, 3, 0, 1]


def test_the_usage_is_found_when_the_kept_tail_starts_at_a_brace() -> None:
    """The tail of a long answer is cut at any byte: where it happens to start with ``{``
    (an event's data, a tool's schema), it is a piece of JSON, not a JSON body."""
    usage = {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 512}}
    events = [b'data: {"choices": [{"delta": {"content": "t%d"}}]}\n\n' % i for i in range(900)]
    events.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    # A keep-alive comment of the length that puts the tail's first byte on a brace.
    pads = [b": " + b"x" * n + b"\n\n" for n in range(64)]
    pad = next(p for p in pads if b"".join([*events, p])[-UsageTap.TAIL_BYTES] == ord("{"))
    tracker = Recorder()
    tap = UsageTap(tracker, "e", RoutingRequest("r", "m"))
    for event in (*events, pad):
        tap(event)
    assert tap.tail().startswith(b"{")
    tap.finish()
    assert tracker.seen == [("e", usage)]
    tools = [{"type": "function", "parameters": {"a": {"b": n}}} for n in range(900)]
    body = orjson.dumps({"id": "resp_1", "tools": tools, "usage": usage})
    cuts = [n for n in range(1, 200) if body[-UsageTap.TAIL_BYTES - n] == ord("{")]
    assert cuts and find_usage(body[-UsageTap.TAIL_BYTES - cuts[0] :]) == usage
