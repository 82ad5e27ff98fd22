"""The router's leases: what a streamed first byte teaches, and how many it learns from."""

from __future__ import annotations

import asyncio

import orjson

from router.app import build_gateway
from router.config.model import parse_config
from router.core.endpoints import SharedPrefix
from router.core.framework import RoutingRequest
from router.core.sampling import RateSampler
from router.estimators.calibration import Calibrator
from router.protocol.parsing import parse_request
from router.scheduling.routing import Router
from tests.manual_clock import ManualClock
from tests.snapshots import snap

URL = "http://127.0.0.1:9"


class Observed(Calibrator):
    def __init__(self) -> None:
        super().__init__()
        self.first_bytes: list[str] = []

    def observe(self, endpoint_id: str, *args: float, **kwargs: float) -> None:
        self.first_bytes.append(endpoint_id)
        super().observe(endpoint_id, *args, **kwargs)


def answered(router: Router, endpoint: str) -> None:
    """One streamed request leased to ``endpoint``: its first byte, then its end."""
    lease = router.lease(RoutingRequest("r", "m", stream=True, prompt_tokens=100), snap(endpoint))
    lease.first_byte()
    lease.release()


def test_streamed_first_bytes_beyond_the_learning_rate_are_not_learned_from() -> None:
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL}]}}))
    calibrator, clock = Observed(), ManualClock()
    router = Router(
        gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics,
        calibrator=calibrator, learning=RateSampler(10.0, 2.0, clock),
    )
    endpoint = next(iter(gw.pool)).endpoint.id
    for _ in range(5):
        answered(router, endpoint)
    assert calibrator.first_bytes == [endpoint] * 2, "a burst of two, then the rate"
    clock.now += 0.1  # one more at 10 a second
    answered(router, endpoint)
    answered(router, endpoint)
    assert len(calibrator.first_bytes) == 3
    # Every lease still counted and released: only the learning was skipped.
    state = gw.pool.get(endpoint)
    assert state is not None and state.in_flight == 0


def test_without_a_sampler_every_streamed_first_byte_is_learned_from() -> None:
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL}]}}))
    calibrator = Observed()
    router = Router(
        gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics,
        calibrator=calibrator,
    )
    endpoint = next(iter(gw.pool)).endpoint.id
    for _ in range(300):
        answered(router, endpoint)
    assert len(calibrator.first_bytes) == 300


async def test_taking_an_endpoint_tells_flow_control_the_request_is_placed() -> None:
    gw = build_gateway(
        parse_config({"pool": {"endpoints": [{"url": URL}]}, "flowControl": {"enabled": True}})
    )
    router = Router(gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics)
    state = next(iter(gw.pool))
    state.healthy, state.models = True, {"m"}
    endpoint = state.endpoint.id
    routing = RoutingRequest("r", "m", stream=True, prompt_tokens=100)
    ticket = await router.admit(routing, {}, 10)
    assert not ticket.was_leased
    router.lease(routing, snap(endpoint)).release()
    assert ticket.was_leased
    ticket.release()


async def test_a_lease_given_up_before_its_first_byte_dispatches_queued_work_at_once() -> None:
    """The endpoint failed before any byte (or the client left) and failover moves on: the
    request keeps its ticket, but the place its lease held is free, and queued work takes it
    now, not on the next dispatch tick (none runs here: the flow controller is not started)."""
    flow = {"enabled": True, "saturationDetector": {"concurrencyLimit": {"initialLimit": 1}}}
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL}]}, "flowControl": flow}))
    router = Router(gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics)
    state = next(iter(gw.pool))
    state.healthy, state.models = True, {"m"}
    endpoint = state.endpoint.id
    first = RoutingRequest("r1", "m", stream=True, prompt_tokens=100)
    ticket = await router.admit(first, {}, 10)
    lease = router.lease(first, snap(endpoint))  # waiting for its first byte: the limit of one
    queued = asyncio.create_task(
        router.admit(RoutingRequest("r2", "m", stream=True, prompt_tokens=100), {}, 10)
    )
    for _ in range(5):
        await asyncio.sleep(0)
    assert not queued.done() and gw.flow.queued == 1
    lease.release()
    for _ in range(5):
        await asyncio.sleep(0)
    assert queued.done(), "the place given up waits for the dispatch tick"
    queued.result().release()
    ticket.release()


def test_a_follow_up_to_a_stored_response_is_neither_looked_up_nor_indexed() -> None:
    """Its input is the end of the replica's prompt (the stored turns come first): hashed
    from the start, its blocks would claim a prefix no replica holds."""
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL, "models": ["m"]}]}}))
    text = "please go on with the next step of the plan " * 20
    fresh = {"model": "m", "input": text}
    follow_up = {**fresh, "previous_response_id": "resp_0123"}
    routings = [
        gw.router.routing_request(parse_request("responses", orjson.dumps(body)), {}, "r")
        for body in (fresh, follow_up)
    ]
    assert routings[0].block_hashes, "the same input, sent fresh, is indexed"
    assert routings[1].block_hashes == ()
    assert routings[1].prompt_tokens == routings[0].prompt_tokens  # its own input still counts


def test_a_first_byte_tells_flow_control_the_queue_every_gateway_had_there() -> None:
    """The ranking's snapshot counts other gateways' requests waiting for a first byte (other
    workers, other replicas sharing Redis), as flow control's room does: the learned limit
    grows when that queue, not this gateway's share of it, reached the limit."""
    config = {"pool": {"endpoints": [{"url": URL}]}, "flowControl": {"enabled": True}}
    gw = build_gateway(parse_config(config))
    router = Router(gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics)
    state = next(iter(gw.pool))
    endpoint = state.endpoint.id
    assert gw.flow.limits is not None
    limit = gw.flow.limits.limit(endpoint)
    routing = RoutingRequest("r", "m", stream=True, prompt_tokens=100)
    shared = snap(endpoint, pending_prefill_requests=limit - 1, in_flight=limit - 1)
    lease = router.lease(routing, shared)  # this gateway has none of them
    lease.first_byte()
    lease.release()
    assert gw.flow.limits.limit(endpoint) == limit + 1


async def test_a_first_byte_from_an_endpoint_that_left_teaches_nothing() -> None:
    """Discovery forgot the endpoint (a deleted pod) while a stream on it still waited for its
    first byte: learning from it would bring its limit and calibration back, for good."""
    config = {"pool": {"endpoints": [{"url": URL}]}, "flowControl": {"enabled": True}}
    gw = build_gateway(parse_config(config))
    calibrator = Observed()
    router = Router(
        gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics,
        calibrator=calibrator,
    )
    endpoint = next(iter(gw.pool)).endpoint.id
    lease = router.lease(RoutingRequest("r", "m", stream=True, prompt_tokens=100), snap(endpoint))
    gw.pool.remove(endpoint)
    await calibrator.forget_endpoint(endpoint)
    await gw.flow.forget_endpoint(endpoint)
    lease.first_byte()
    lease.release()
    assert calibrator.first_bytes == []
    assert gw.flow.limits is not None and dict(gw.flow.limits.items()) == {}


def test_the_current_snapshot_of_an_endpoint_counts_what_happened_since_the_ranking() -> None:
    """A retry's lease, or a decode's after its prefill step, reads the queue as it is now."""
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL, "models": ["m"]}]}}))
    router = Router(gw.config, gw.pool, gw.pool.candidates, gw.scheduler, gw.flow, gw.metrics)
    state = next(iter(gw.pool))
    state.healthy = True
    ranked = gw.pool.candidates("m")[0]
    later = gw.pool.lease(state.endpoint.id, 500)  # another request placed there since
    now = router.current("m", ranked.id)
    assert now is not None and (now.in_flight, now.pending_prefill_requests) == (1, 1)
    assert (ranked.in_flight, ranked.pending_prefill_requests) == (0, 0)
    later.release()
    assert router.current("m", "10.0.0.9:1") is None, "no longer a candidate"


def test_a_lease_claims_the_answer_learned_and_a_sessions_context_once() -> None:
    """The KV a request holds where it goes: its prompt and the answer its model's answers have
    been running to; a sub-agent beside another of its session adds only its own part."""
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL, "models": ["m"]}]}}))
    endpoint = next(iter(gw.pool)).endpoint.id
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 4_000}]}
    parsed = parse_request("chat", orjson.dumps(body))
    headers = {"x-session-id": "s"}
    assert gw.router.routing_request(parsed, headers, "r0").answer_tokens == 0
    usage = {"prompt_tokens": 1_000, "completion_tokens": 200}
    gw.prediction.observe(endpoint, gw.router.routing_request(parsed, {}, "r1"), usage)
    first = gw.router.routing_request(parsed, headers, "r2")
    second = gw.router.routing_request(parsed, headers, "r3")
    assert first.answer_tokens == 200
    state = gw.pool.get(endpoint)
    assert state is not None
    one = gw.router.lease(first, snap(endpoint))
    assert state.in_flight_kv_tokens == first.prompt_tokens + 200
    second.prefix_hits = {endpoint: len(second.block_hashes)}  # the first one's prompt, cached
    two = gw.router.lease(second, snap(endpoint))
    own = second.uncached_tokens(endpoint) + 200
    assert own < second.prompt_tokens
    assert state.in_flight_kv_tokens == first.prompt_tokens + 200 + own
    one.release()
    two.release()
    assert state.in_flight_kv_tokens == 0


def test_leases_of_sessions_sharing_a_prefix_hold_it_once() -> None:
    """Two sessions of one agent type on one endpoint: their shared system prompt is held once
    (the live sessions' producer names it: router/estimators/live_sessions.py)."""
    gw = build_gateway(parse_config({"pool": {"endpoints": [{"url": URL, "models": ["m"]}]}}))
    endpoint = next(iter(gw.pool)).endpoint.id
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x" * 4_000}]}
    parsed = parse_request("chat", orjson.dumps(body))
    system = SharedPrefix(key=1, tokens=600, blocks=6)
    requests = [gw.router.routing_request(parsed, {"x-session-id": s}, s) for s in ("a", "b")]
    for request in requests:
        request.shared_prefix = system
    state = gw.pool.get(endpoint)
    assert state is not None
    leases = [gw.router.lease(request, snap(endpoint)) for request in requests]
    prompt = requests[0].prompt_tokens
    assert state.in_flight_kv_tokens == 600 + 2 * (prompt - 600)
    for lease in leases:
        lease.release()
    assert (state.in_flight_kv_tokens, state.prefix_kv) == (0, {})
