"""The simulator's KV events: recorded from the real cache, published like vLLM's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.kv_cache import KVCache, extend_block_hashes
from benchmarks.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    encode_batch,
    encode_event,
)

BS = 4


def chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS, None)
    return hashes


def fill(kv: KVCache, tokens: list[int]) -> list[int]:
    hashes = chain(tokens)
    admitted = kv.admit(hashes, len(tokens))
    assert admitted is not None
    blocks, _ = admitted
    kv.cache_blocks(blocks, hashes, 0, len(tokens) // BS, tokens)
    kv.free(blocks)
    return hashes


def test_stored_events_carry_parent_and_tokens_of_new_blocks_only() -> None:
    kv = KVCache(16, BS)
    kv.enable_events()
    first = list(range(9))
    hashes = fill(kv, first)
    events = kv.take_events()
    assert events == [BlockStored(hashes[:2], None, first[:8], BS, extra_keys=[None, None])]
    # The second request shares the first two blocks: only its third one is new.
    second = [*range(12), 50]
    hashes2 = fill(kv, second)
    assert kv.take_events() == [
        BlockStored(hashes2[2:3], hashes2[1], second[8:12], BS, extra_keys=[None])
    ]
    assert kv.take_events() == []


def test_evictions_and_reset_are_events_and_replaying_them_gives_the_cache() -> None:
    kv = KVCache(4, BS)
    kv.enable_events()
    held: set[int] = set()
    for start in (0, 100, 200, 300):
        fill(kv, list(range(start, start + 8)))
    for event in kv.take_events():
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
    assert held == set(kv.cached_hashes())
    assert kv.reset()
    assert kv.take_events() == [AllBlocksCleared()]


def test_a_salted_request_s_first_block_carries_its_salt_as_vllm_s_extra_keys() -> None:
    from router.precise.event_codec import EventBatch, apply_batch, decode_event
    from router.precise.index import PreciseIndex
    from router.precise.keys import request_keys

    kv = KVCache(16, BS)
    kv.enable_events()
    tokens = list(range(9))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS, "tenant-a")
    admitted = kv.admit(hashes, len(tokens))
    assert admitted is not None
    kv.cache_blocks(admitted[0], hashes, 0, 2, tokens, "tenant-a")
    events = kv.take_events()
    assert [e.extra_keys for e in events if isinstance(e, BlockStored)] == [[["tenant-a"], None]]
    # The gateway's precise index credits the same salt's requests only.
    index = PreciseIndex(block_size=BS)
    decoded = [decode_event(msgpack.unpackb(msgpack.packb(encode_event(e, "array"))))
               for e in events]
    apply_batch(index, "r0", EventBatch(0.0, [e for e in decoded if e is not None]))
    salted = request_keys(tokens, BS, cache_salt="tenant-a")
    assert index.match(salted, ["r0"]) == {"r0": 2}
    assert index.match(request_keys(tokens, BS), ["r0"]).get("r0", 0) == 0
    assert index.match(request_keys(tokens, BS, cache_salt="b"), ["r0"]).get("r0", 0) == 0


def test_events_are_off_by_default() -> None:
    kv = KVCache(4, BS)
    fill(kv, list(range(8)))
    assert kv.take_events() == []


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_encodings(encoding: str) -> None:
    stored = BlockStored([1, 2], None, [5, 6, 7, 8], 2)
    raw = encode_event(stored, "map" if encoding == "map" else "array")
    if encoding == "map":
        assert raw == {
            "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
            "token_ids": [5, 6, 7, 8], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": None,
        }
    else:
        assert raw == ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None, None]
    payload = msgpack.unpackb(encode_batch([stored, AllBlocksCleared()], "array", ts=1.5))
    first = raw if encoding == "array" else payload[1][0]
    assert payload == [1.5, [first, ["AllBlocksCleared"]], 0]


async def wait_for(predicate: Callable[[], bool], seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.01)


async def test_publisher_frames_and_replay() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@x:1@m", replay_port=0)
    pub.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.address)
        frames: list[list[bytes]] = []

        async def receive() -> None:
            frames.append(await sub.recv_multipart())

        # The first messages may go before the subscription reaches the publisher.
        async with asyncio.timeout(5):
            while not frames:
                pub.publish([AllBlocksCleared()])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(receive(), 0.05)
        topic, seq, payload = frames[0]
        assert topic == b"kv@x:1@m" and len(seq) == 8
        assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        assert pub.replay_address is not None
        dealer.connect(pub.replay_address)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        async with asyncio.timeout(5):
            while True:
                _, seq_bytes, body = await dealer.recv_multipart()
                if not body:
                    assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                    break
                replayed.append(int.from_bytes(seq_bytes, "big"))
        assert replayed == list(range(pub.published))
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        await pub.aclose()


async def test_replicas_publish_their_cache_on_consecutive_ports() -> None:
    config = SimConfig(speed=100.0, num_gpu_blocks=24, kv_events_port=0)
    async with start_replicas(2, config) as replicas:
        addresses = {r.kv_events_address for r in replicas}
        assert len(addresses) == 2 and None not in addresses
        rep = replicas[0]
        assert rep.kv_events_address is not None
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(rep.kv_events_address)
        held: set[int] = set()
        seqs: list[int] = []

        async def drain() -> None:
            while await sub.poll(50):
                _, seq, payload = await sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                for ev in msgpack.unpackb(payload)[1]:
                    if ev[0] == "BlockStored":
                        held.update(ev[1])
                    elif ev[0] == "BlockRemoved":
                        held.difference_update(ev[1])

        try:
            publisher = rep.sim.kv_publisher
            assert publisher is not None
            # Messages sent before the subscription reaches the publisher are lost: probe with
            # harmless clears (the cache is empty) until one arrives.
            async with asyncio.timeout(5):
                while not seqs:
                    publisher.publish([AllBlocksCleared()])
                    await drain()
            async with httpx.AsyncClient(base_url=rep.url, timeout=10) as client:
                for i in range(12):  # 12 prompts of ~10 blocks through 24 blocks: evictions
                    body = {"model": "sim-model", "prompt": f"topic {i} " * 40, "max_tokens": 4}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                    await drain()
            await drain()
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert len(seqs) > 12
            assert held == set(rep.engine.kv.cached_hashes())
        finally:
            sub.close(0)
            ctx.term()


def test_config_rejects_unknown_encoding() -> None:
    with pytest.raises(ValueError):
        SimConfig(kv_events_encoding="json")


def test_each_copy_of_a_block_is_stored_and_removed_as_vllm_does() -> None:
    # A repeated 8-token prompt recomputes its last block (the hit is capped at 7 tokens) and
    # vLLM caches that copy too: a BlockStored for it, and a BlockRemoved per evicted copy.
    kv = KVCache(3, BS)
    kv.enable_events()
    prompt = list(range(8))
    hashes = fill(kv, prompt)
    kv.take_events()
    fill(kv, prompt)
    assert kv.take_events() == [
        BlockStored(hashes[1:2], hashes[0], prompt[4:8], BS, extra_keys=[None])
    ]
    copies: dict[int, int] = {}
    for _ in range(3):
        assert kv.allocate_block() is not None
    for event in kv.take_events():
        assert isinstance(event, BlockRemoved)
        for h in event.block_hashes:
            copies[h] = copies.get(h, 0) + 1
    assert copies == {hashes[0]: 1, hashes[1]: 2}
