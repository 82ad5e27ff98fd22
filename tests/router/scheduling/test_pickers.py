from __future__ import annotations

import random

from router.core.framework import RoutingRequest
from router.scheduling.pickers import MaxScorePicker
from tests.snapshots import snap

ENDPOINTS = [snap("a"), snap("b"), snap("c")]


def req(hits: dict[str, int] | None = None) -> RoutingRequest:
    return RoutingRequest(
        request_id="r", model="m", prompt_tokens=1000, prompt_bytes=4000, block_bytes=256,
        block_hashes=tuple(range(16)), prefix_hits=hits or {},
    )


def ids(picker: MaxScorePicker, request: RoutingRequest, scores: list[float]) -> list[str]:
    return [e.id for e in picker.pick(request, ENDPOINTS, scores)]


def test_highest_total_first_then_the_rest_in_order() -> None:
    picker = MaxScorePicker(random.Random(0))
    assert ids(picker, req({"c": 16}), [0.5, 1.0, 0.95]) == ["b", "c", "a"]


def test_exact_ties_are_broken_at_random() -> None:
    firsts = {ids(MaxScorePicker(random.Random(s)), req(), [1.0, 1.0, 0.2])[0] for s in range(40)}
    assert firsts == {"a", "b"}
