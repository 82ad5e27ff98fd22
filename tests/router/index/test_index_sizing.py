"""Index capacity per endpoint from its KV tokens at the learned bytes per token."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.core.endpoints import Endpoint
from router.core.framework import RoutingRequest
from router.core.pool import EndpointPool
from router.estimators.token_density import TokenDensity
from router.index.prefix_index import InMemoryPrefixIndex
from router.index.sizing import IndexSizer

BLOCK_BYTES = 256
KV_TOKENS = 16 * 4096


class Recording(InMemoryPrefixIndex):
    def __init__(self) -> None:
        super().__init__()
        self.sets: list[tuple[str, int]] = []

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        self.sets.append((endpoint_id, blocks))
        super().set_capacity(endpoint_id, blocks)


def _answer(sizer: IndexSizer, endpoint: str, ratio: float, n: int, **kw: object) -> None:
    for i in range(n):
        size = 10_000 + 100 * i
        routing = RoutingRequest("r", "m", prompt_bytes=size, **kw)  # type: ignore[arg-type]
        sizer.observe(endpoint, routing, {"prompt_tokens": round(size / ratio)})


def test_capacity_starts_at_the_prior_and_follows_the_learned_ratio() -> None:
    index, registry = Recording(), CollectorRegistry()
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES, registry=registry)
    sizer.kv_capacity("e1", KV_TOKENS)
    assert index.capacity("e1") == KV_TOKENS * 4 // BLOCK_BYTES
    _answer(sizer, "e1", 9.0, 40)
    assert index.capacity("e1") == int(KV_TOKENS * sizer.density.ratio("m") // BLOCK_BYTES)
    assert abs(index.capacity("e1") - KV_TOKENS * 9 // BLOCK_BYTES) <= 2
    # Re-derived when the ratio moved materially, not on every answer.
    assert len(index.sets) == 2
    gauge = registry.get_sample_value(
        "prefixgate_prefix_index_capacity_blocks", {"endpoint": "e1"}
    )
    assert gauge == index.capacity("e1")


def test_an_endpoint_reporting_its_kv_later_gets_the_learned_ratio() -> None:
    index = Recording()
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES, models={"e2": "m"})
    _answer(sizer, "e1", 3.0, 10)
    sizer.kv_capacity("e2", KV_TOKENS)  # configured to serve m: m's ratio applies
    assert index.sets == [("e2", KV_TOKENS * 3 // BLOCK_BYTES)]
    assert sizer.capacity_blocks("e2") == KV_TOKENS * 3 // BLOCK_BYTES


def test_an_endpoint_that_answered_nothing_follows_the_model_learned_elsewhere() -> None:
    index = Recording()
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES)
    sizer.kv_capacity("idle", KV_TOKENS)
    _answer(sizer, "busy", 9.0, 10)
    assert index.sets[-1] == ("idle", int(KV_TOKENS * sizer.density.ratio("m") // BLOCK_BYTES))


def test_an_explicit_capacity_is_never_overridden() -> None:
    index = Recording()
    sizer = IndexSizer(index, TokenDensity(min_samples=1), BLOCK_BYTES, fixed_blocks=500)
    sizer.kv_capacity("e1", KV_TOKENS)
    _answer(sizer, "e1", 9.0, 20)
    assert index.sets == [] and sizer.capacity_blocks("e1") == 500
    assert sizer.density.ratio("m") > 8  # still learned (and exported)


def test_stored_conversations_and_odd_usage_teach_nothing() -> None:
    sizer = IndexSizer(Recording(), TokenDensity(min_samples=1), BLOCK_BYTES)
    _answer(sizer, "e1", 1.5, 5, previous_response_id="resp_1")
    sizer.observe("e1", RoutingRequest("r", "m", prompt_bytes=900), {"prompt_tokens": "x"})
    sizer.observe("e1", RoutingRequest("r", "m", prompt_bytes=900), None)
    assert sizer.density.samples("m") == 0


async def test_a_departed_endpoint_is_forgotten() -> None:
    index, registry = Recording(), CollectorRegistry()
    sizer = IndexSizer(index, TokenDensity(), BLOCK_BYTES, registry=registry)
    sizer.kv_capacity("e1", KV_TOKENS)
    await sizer.forget_endpoint("e1")
    await sizer.forget_endpoint("never-seen")
    assert sizer.capacity_blocks("e1") is None
    name = "prefixgate_prefix_index_capacity_blocks"
    assert registry.get_sample_value(name, {"endpoint": "e1"}) is None


def test_a_configured_model_keeps_its_ratio_when_another_model_answers_there() -> None:
    # An endpoint configured with one model also serves what its /v1/models lists (a LoRA
    # adapter): the configured model's ratio sizes it (docs/prefix-index.md), so an answer of
    # the adapter, still at the prior, does not shrink its index.
    index = Recording()
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES, models={"e1": "m"})
    sizer.kv_capacity("e1", KV_TOKENS)
    _answer(sizer, "e1", 9.0, 10)
    sized = index.capacity("e1")
    assert abs(sized - KV_TOKENS * 9 // BLOCK_BYTES) <= 2
    sizer.count("e1", "m-lora", 10_000, 2_500)
    assert index.capacity("e1") == sized
    assert sizer.capacity_blocks("e1") == sized


async def test_an_answer_ending_after_its_endpoint_left_brings_none_of_it_back() -> None:
    """A response or a token count still running when its pod went away ends after the pod
    was forgotten: the model's bytes per token learn from it, but nothing of the departed
    endpoint comes back (kept for good otherwise: pods come and go under new addresses)."""
    index, registry = Recording(), CollectorRegistry()
    pool = EndpointPool([Endpoint.from_url("http://127.0.0.1:9001")])
    (state,) = pool
    gone = state.endpoint.id
    sizer = IndexSizer(
        index, TokenDensity(min_samples=4), BLOCK_BYTES, pool=pool, registry=registry
    )
    sizer.kv_capacity(gone, KV_TOKENS)
    _answer(sizer, gone, 3.0, 2)
    pool.remove(gone)
    await sizer.forget_endpoint(gone)
    sets = len(index.sets)
    _answer(sizer, gone, 9.0, 10)  # the late answers
    sizer.kv_capacity(gone, KV_TOKENS)  # and a late scrape
    assert sizer.density.samples("m") == 12
    assert gone not in sizer._models, "its model is not remembered for good"
    assert sizer.capacity_blocks(gone) is None and len(index.sets) == sets
    name = "prefixgate_prefix_index_capacity_blocks"
    assert registry.get_sample_value(name, {"endpoint": gone}) is None


def test_a_discovered_endpoint_with_one_configured_model_keeps_its_ratio_too() -> None:
    """Endpoints discovered in Kubernetes with ``discovery.models: [m]`` join the pool after
    the sizer was built: m sizes them as it does a static endpoint configured with m, so an
    adapter's answer, its ratio still the prior, does not shrink their index."""
    index = Recording()
    pool = EndpointPool()
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES, pool=pool)
    _answer(sizer, "static", 9.0, 10)  # m's ratio, learned before the pod came
    joined = pool.add(Endpoint.from_url("http://127.0.0.1:9001", models=["m"])).endpoint.id
    sizer.count(joined, "m-lora", 10_000, 2_500)  # its first answer: an adapter's
    sizer.kv_capacity(joined, KV_TOKENS)
    sized = index.capacity(joined)
    assert abs(sized - KV_TOKENS * 9 // BLOCK_BYTES) <= 2
    sizer.count(joined, "m-lora", 10_000, 2_500)
    assert index.capacity(joined) == sized


def test_an_endpoint_is_sized_by_the_base_model_its_adapters_run_on() -> None:
    """vLLM's /v1/models names each LoRA adapter's base model (``parent``): the adapters' KV
    is the base model's, so an adapter's answer, its ratio still the prior, does not shrink
    the index of an endpoint whose base model is known (each change would evict)."""
    index = Recording()
    pool = EndpointPool([Endpoint.from_url("http://127.0.0.1:9001")])
    (state,) = pool
    endpoint = state.endpoint.id
    sizer = IndexSizer(index, TokenDensity(min_samples=4), BLOCK_BYTES, pool=pool)
    sizer.base_model(endpoint, "m")  # told by its /v1/models
    sizer.kv_capacity(endpoint, KV_TOKENS)
    _answer(sizer, endpoint, 9.0, 10)
    sized = index.capacity(endpoint)
    assert abs(sized - KV_TOKENS * 9 // BLOCK_BYTES) <= 2
    sizer.count(endpoint, "m-lora", 10_000, 2_500)
    assert index.capacity(endpoint) == sized
