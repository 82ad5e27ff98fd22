"""The load generator's parsing of streamed answers and its open-loop arrivals."""

from __future__ import annotations

import itertools

import orjson
import pytest

from benchmarks.bench.client import WorkloadClient, _consume, _Stream
from benchmarks.workloads import build_workload


def _data(event: object) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n"


def test_stream_parsing_times_the_first_content_token_and_keeps_usage() -> None:
    s = _Stream()
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    _consume(s, _data(role_only), 1.0)
    assert s.first is None  # an empty delta is not a token
    _consume(s, _data({"choices": [{"delta": {"content": "hel"}}]}), 2.0)
    _consume(s, b"\n", 2.5)
    _consume(s, _data({"choices": [{"text": "lo"}]}), 3.0)  # completions' shape
    usage = {"prompt_tokens": 9, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    _consume(s, _data({"choices": [], "usage": usage}), 4.0)
    _consume(s, b"data: [DONE]\n", 5.0)
    assert (s.first, s.last, s.chunks, "".join(s.answer)) == (2.0, 3.0, 2, "hello")
    assert s.usage == usage and s.error is None


def test_stream_parsing_catches_a_mid_stream_error() -> None:
    s = _Stream()
    _consume(s, _data({"error": {"message": "boom", "type": "internal_error"}}), 1.0)
    assert s.error == "boom"


def test_open_loop_arrivals_are_seeded_poisson_in_wall_seconds() -> None:
    workload = build_workload("shared-prefix", "small", rate=4.0)
    client = WorkloadClient(["http://127.0.0.1:1"], workload, speed=10.0)
    starts = client._arrivals()
    assert starts == WorkloadClient(["http://x"], workload, speed=10.0)._arrivals()
    assert starts[0] == 0 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Mean gap 1/rate simulated seconds = 1/(rate * speed) wall seconds.
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 40, rel=0.25)
    closed = WorkloadClient(["http://x"], build_workload("shared-prefix", "tiny"), speed=10.0)
    assert set(closed._arrivals()) == {0.0}
