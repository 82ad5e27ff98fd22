"""vLLM's extra keys in the precise index: a block cached under a cache salt, a LoRA adapter or
with media is another cache entry than the same tokens without, and is matched only by requests
that would hit it in the engine (router/precise/keys.py, extras.py, event_codec.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import orjson
import pytest

from router.config.precise import PrecisePrefixConfig
from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.precise.event_codec import Stored, apply_batch, decode_batch
from router.precise.extras import NO_EXTRAS
from router.precise.index import PreciseIndex, block_keys
from router.precise.keys import request_keys
from router.precise.routing import PreciseSettings, PreciseTracker
from router.precise.tokenizers import TokenizeInput
from router.protocol.parsing import Api, parse_request
from tests.router.precise.test_precise_redis import replicas

BS = 4
TOKENS = list(range(100, 112))  # three blocks
A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


class FixedTokenizer:
    """Every prompt is TOKENS: only the request's other fields tell requests apart."""

    async def tokenize(
        self, request: TokenizeInput, endpoints: Sequence[EndpointSnapshot]
    ) -> list[int]:
        return TOKENS

    async def aclose(self) -> None:
        pass


def stored(hashes: list[int], parent: int | None, tokens: list[int], **fields: Any) -> list[Any]:
    """A BlockStored as vLLM's publisher encodes it (tagged array, trailing defaults left out)."""
    order = ("lora_id", "medium", "lora_name", "extra_keys")
    values = {"lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    tail = [values.get(name) for name in order]
    while tail and tail[-1] is None:
        tail.pop()
    return ["BlockStored", hashes, parent, tokens, BS, *tail]


def feed(index: PreciseIndex, endpoint_id: str, *events: list[Any] | dict[str, Any]) -> None:
    batch = decode_batch(msgpack.packb([1.0, list(events), 0]))
    assert apply_batch(index, endpoint_id, batch) == 0
    index.set_trusted(endpoint_id, True)


def snapshot(eid: str) -> EndpointSnapshot:
    return EndpointSnapshot(eid, f"http://{eid}", "both", 0, 0, 0.0, 0.0, 0.0, 0.0)


class Gateway:
    """A precise tracker over one index, fed with requests as the router hands them over."""

    def __init__(self, index: PreciseIndex, **config: Any) -> None:
        settings = PreciseSettings(PrecisePrefixConfig(block_size=BS, **config))
        self.tracker = PreciseTracker(index, FixedTokenizer(), settings)
        self.serial = 0

    async def scores(self, body: dict[str, Any], api: Api = "chat") -> dict[str, float] | None:
        """The held share per endpoint; None when the request got no precise scores."""
        self.serial += 1
        parsed = parse_request(api, orjson.dumps(body))
        self.tracker.attach(self.serial, parsed)
        request = RoutingRequest(f"r{self.serial}", parsed.model, serial=self.serial)
        endpoints = [snapshot(e) for e in (A, B, C, D)]
        await self.tracker.produce(request, endpoints)
        scores = self.tracker.scores(request, endpoints)
        return None if scores is None else {e.id: s for e, s in zip(endpoints, scores, strict=True)}


def chat(model: str = "base", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


def held(scores: dict[str, float] | None) -> set[str]:
    assert scores is not None
    return {eid for eid, share in scores.items() if share}


# -- cache_salt ----------------------------------------------------------------------------------


def test_a_salt_changes_every_key_of_the_chain_and_no_salt_changes_none() -> None:
    plain = block_keys(TOKENS, BS)
    assert request_keys(TOKENS, BS) == plain
    salted = request_keys(TOKENS, BS, cache_salt="tenant-1")
    assert len(salted) == 3 and not set(salted) & set(plain)
    assert not set(salted) & set(request_keys(TOKENS, BS, cache_salt="tenant-2"))
    assert request_keys(TOKENS, BS, max_blocks=2, cache_salt="tenant-1") == salted[:2]


async def test_a_salted_request_matches_only_blocks_cached_under_its_salt() -> None:
    index = PreciseIndex(BS)
    # vLLM sends extra_keys per block: nil for none, the salt on a salted chain's first block.
    feed(index, A, stored([1, 2, 3], None, TOKENS, extra_keys=[None, None, None]))
    feed(
        index, B,
        stored([4, 5], None, TOKENS[:8], extra_keys=[["tenant-1"], None]),
        stored([6], 5, TOKENS[8:], extra_keys=[None]),  # the chain continues, salt-free
    )
    as_map = {  # the other encoding: a map with a "type" key
        "type": "BlockStored", "block_hashes": [7, 8, 9], "parent_block_hash": None,
        "token_ids": TOKENS, "block_size": BS, "medium": "GPU",
        "extra_keys": [["tenant-2"], None, None],
    }
    feed(index, C, as_map)
    gw = Gateway(index)
    assert await gw.scores(chat()) == {A: 1.0, B: 0.0, C: 0.0, D: 0.0}
    assert await gw.scores(chat(cache_salt="tenant-1")) == {A: 0.0, B: 1.0, C: 0.0, D: 0.0}
    assert held(await gw.scores(chat(cache_salt="tenant-2"))) == {C}
    assert held(await gw.scores(chat(cache_salt="tenant-3"))) == set()
    completion = {"model": "base", "prompt": "hi", "cache_salt": "tenant-1"}
    assert held(await gw.scores(completion, "completions")) == {B}


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
async def test_a_salt_vllm_refuses_gets_no_precise_state(salt: Any) -> None:
    gw = Gateway(PreciseIndex(BS))
    assert await gw.scores(chat(cache_salt=salt)) is None
    assert gw.tracker.state(gw.serial) is None


# -- LoRA adapters -------------------------------------------------------------------------------


def adapter_fleet() -> PreciseIndex:
    """A: the base model's blocks; B: adapter sql's from a vLLM that names the adapter but
    publishes no extra keys; C: adapter chat's with extra keys, partly under a salt; D: an
    adapter known by its number only (older vLLM)."""
    index = PreciseIndex(BS)
    feed(index, A, stored([1, 2, 3], None, TOKENS))
    feed(index, B, stored([4, 5, 6], None, TOKENS, lora_id=1, lora_name="sql"))
    extra = [["chat", "s"], ["chat"], ["chat"]]
    feed(index, C, stored([7, 8, 9], None, TOKENS, lora_id=2, lora_name="chat", extra_keys=extra))
    feed(index, D, stored([10, 11, 12], None, TOKENS, lora_id=3))
    return index


async def test_adapters_named_in_events_match_only_their_own_blocks() -> None:
    gw = Gateway(adapter_fleet())
    assert held(await gw.scores(chat("base"))) == {A}
    assert held(await gw.scores(chat("sql"))) == {B}
    assert held(await gw.scores(chat("chat", cache_salt="s"))) == {C}
    assert held(await gw.scores(chat("chat"))) == set()  # C's chain is salted


async def test_with_base_models_configured_any_other_model_is_an_adapter() -> None:
    gw = Gateway(adapter_fleet(), base_models=["base", "base-alias"])
    assert held(await gw.scores(chat("base-alias"))) == {A}
    assert held(await gw.scores(chat("sql"))) == {B}
    # No event has named this adapter yet: it is still not credited with the base's blocks.
    assert held(await gw.scores(chat("new-adapter"))) == set()


def test_an_adapter_known_by_number_only_is_matched_by_no_request() -> None:
    index = adapter_fleet()
    for lora_name in (None, "1", "3", "sql"):
        keys = request_keys(TOKENS, BS, lora_name=lora_name)
        assert index.match(keys, [D]) == {D: 0}


def test_extra_keys_that_do_not_line_up_with_the_blocks_match_nothing() -> None:
    index = PreciseIndex(BS)
    feed(index, A, stored([1, 2, 3], None, TOKENS, extra_keys=[None, None]))
    assert index.match(block_keys(TOKENS, BS), [A]) == {A: 0}


# -- media ---------------------------------------------------------------------------------------


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}}
MEDIA_REQUESTS: list[tuple[Api, dict[str, Any]]] = [
    ("chat", {"model": "base", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is this"}, IMAGE]}]}),
    ("chat", {"model": "base", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
    ("messages", {"model": "base", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.png"}}]}]}),
    ("responses", {"model": "base", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.test/cat.png"}]}]}),
    ("completions", {"model": "base", "prompt": "x", "prompt_embeds": "AAAA"}),
]


@pytest.mark.parametrize(("api", "body"), MEDIA_REQUESTS)
async def test_requests_with_media_are_left_to_the_approximate_index(
    api: Api, body: dict[str, Any]
) -> None:
    index = PreciseIndex(BS)
    feed(index, A, stored([1, 2, 3], None, TOKENS))
    gw = Gateway(index)
    assert held(await gw.scores(chat())) == {A}  # the same tokens as text: held
    assert await gw.scores(body, api) is None
    assert gw.tracker.state(gw.serial) is None


async def test_text_parts_are_not_media() -> None:
    index = PreciseIndex(BS)
    feed(index, A, stored([1, 2, 3], None, TOKENS))
    content = [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]
    body = {"model": "base", "messages": [{"role": "user", "content": content}]}
    assert held(await Gateway(index).scores(body)) == {A}


# -- the shared index ----------------------------------------------------------------------------


async def test_a_late_replica_maps_an_adapters_blocks_with_their_extra_keys(
    redis_url: str, redis_namespace: str
) -> None:
    keys = request_keys(TOKENS, BS, lora_name="sql")
    first = Stored([1, 2], None, TOKENS[:8], BS, 1, "GPU", "sql", [["sql"], ["sql"]])
    rest = Stored([3], 2, TOKENS[8:], BS, 1, "GPU", "sql", [["sql"]])
    async with replicas(redis_url, redis_namespace, 2) as (warm, late):
        warm.deliver(A, 0, 1.0, first)
        await warm.shared.flush()
        # The late replica never saw the chain's start: Redis supplies block 2's key.
        late.local.set_trusted(A, False, "sequence gap 0..0; resyncing")
        late.deliver(A, 1, 2.0, rest)
        await late.shared.flush()
        assert late.shared.statuses == {"applied": 1}
        found = await late.lookup(keys, A)
        assert (found[A].trusted, found[A].confirmed) == (True, 3)
        assert (await late.lookup(block_keys(TOKENS, BS), A))[A].confirmed == 0


def test_a_messages_requests_salt_is_not_in_its_keys() -> None:
    """vLLM's Messages route drops cache_salt and caches unsalted: so do the keys."""
    tracker = PreciseTracker(
        PreciseIndex(4), None,  # type: ignore[arg-type]
        PreciseSettings(PrecisePrefixConfig(blockSize=4)),
    )
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 64}],
            "cache_salt": "t"}
    tracker.attach(1, parse_request("messages", orjson.dumps(body)))
    state = tracker.state(1)
    assert state is not None and state.extras == NO_EXTRAS
