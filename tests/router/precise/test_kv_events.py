"""KV event intake: decoding both encodings, sequence gaps, replay, restarts, silence, and the
precise index against the simulators' real caches after eviction pressure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import msgpack
import pytest
from prometheus_client import CollectorRegistry

from benchmarks.sim.cli import start_replicas
from benchmarks.sim.config import SimConfig
from benchmarks.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    encode_batch,
)
from router.config.precise import KVEventsConfig
from router.core.endpoints import endpoint_id_from_url
from router.precise.events import (
    Cleared,
    DecodeError,
    EndpointSubscriber,
    EventSource,
    Removed,
    Stored,
    SubscriberSettings,
    decode_batch,
    derive_sources,
)
from router.precise.events_manager import KVEventsManager
from router.precise.index import PreciseIndex, block_keys

BS = 4
EID = "127.0.0.1:9"


async def wait_for(predicate: Callable[[], bool], seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.01)


async def resync(pub: KVEventPublisher, index: PreciseIndex) -> None:
    """Publish AllBlocksCleared until the endpoint is trusted: a state known from scratch."""
    async with asyncio.timeout(5):
        while not index.trusted(EID):
            pub.publish([AllBlocksCleared()])
            await asyncio.sleep(0.02)


# -- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_decode_both_encodings(encoding: str) -> None:
    enc = "map" if encoding == "map" else "array"
    events = [
        BlockStored([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], BS),
        BlockRemoved([2]),
        AllBlocksCleared(),
    ]
    batch = decode_batch(encode_batch(events, enc, ts=3.0))
    assert batch.ts == 3.0 and batch.dp_rank == 0
    assert batch.events == [
        Stored([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], BS, None, "GPU", None),
        Removed([2], "GPU"),
        Cleared(),
    ]


def test_decode_tolerates_omitted_defaults_bytes_hashes_and_unknown_events() -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [b"\xaa" * 32], None, [1, 2, 3, 4], BS],  # no lora/medium
                ["BlockRemoved", [7]],
                {"type": "SomethingNew", "x": 1},
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    assert batch.events == [
        Stored([b"\xaa" * 32], None, [1, 2, 3, 4], BS),
        Removed([7]),
        Cleared(),
    ]
    as_map = msgpack.packb({"ts": 2, "events": [{"type": "AllBlocksCleared"}]})
    assert decode_batch(as_map).events == [Cleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb("nope"),
        msgpack.packb([1.0, "x"]),
        msgpack.packb([1.0, [["BlockStored", "notalist", None, [], BS]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]),
        msgpack.packb([1.0, [42]]),
        msgpack.packb([1.0, [[]]]),
    ],
)
def test_decode_errors(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_sources_from_config_or_derived() -> None:
    urls = {"10.0.0.1:8000": "http://10.0.0.1:8000", "10.0.0.2:8001": "http://10.0.0.2:8001"}
    explicit = {"10.0.0.2:8001": "tcp://10.0.0.9:1"}
    assert derive_sources(urls, explicit, {}, 5557, None) == [
        EventSource("10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        EventSource("10.0.0.2:8001", "tcp://10.0.0.9:1"),
    ]
    by_offset = derive_sources(urls, {}, {}, None, 100, None, 200)
    assert by_offset[1] == EventSource("10.0.0.2:8001", "tcp://10.0.0.2:8101", "tcp://10.0.0.2:8201")
    assert derive_sources(urls, {}, {}, None, None) == []


# -- one subscriber against a publisher --------------------------------------------------------


@asynccontextmanager
async def subscribed(
    pub: KVEventPublisher, **settings: float
) -> AsyncIterator[tuple[PreciseIndex, KVEventsManager]]:
    index = PreciseIndex(BS)
    source = EventSource(EID, pub.address, pub.replay_address)
    manager = KVEventsManager(
        index,
        [source],
        SubscriberSettings(KVEventsConfig(**settings), tick_seconds=0.02),
        CollectorRegistry(),
    )
    manager.start()
    try:
        sub = manager.subscribers[EID]
        # Probe with clears (harmless: nothing is stored yet) until one arrives.
        async with asyncio.timeout(5):
            while sub.last_seq is None:
                pub.publish([AllBlocksCleared()])
                await asyncio.sleep(0.02)
        await wait_for(lambda: index.trusted(EID))
        yield index, manager
    finally:
        await manager.stop()


def store(pub: KVEventPublisher, hashes: list[int], parent: int | None, start: int, *,
          lost: bool = False) -> list[int]:
    toks = list(range(start, start + BS * len(hashes)))
    pub.publish([BlockStored(hashes, parent, toks, BS)], lost=lost)
    return toks


def sub_of(manager: KVEventsManager) -> EndpointSubscriber:
    return manager.subscribers[EID]


async def test_events_apply_in_order_and_keep_the_endpoint_trusted() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    try:
        async with subscribed(pub) as (index, _):
            toks = store(pub, [1, 2], None, 0) + store(pub, [3], 2, 8)
            keys = block_keys(toks, BS)
            await wait_for(lambda: index.match(keys, [EID]) == {EID: 3})
            pub.publish([BlockRemoved([3])])
            await wait_for(lambda: index.match(keys, [EID]) == {EID: 2})
            pub.publish([AllBlocksCleared()])
            await wait_for(lambda: index.entries(EID) == 0)
            assert index.trusted(EID)
    finally:
        await pub.aclose()


async def test_gap_without_replay_distrusts_and_drops_entries_until_resynced() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    try:
        async with subscribed(pub, resync_seconds=60.0) as (index, manager):
            store(pub, [1], None, 0)
            await wait_for(lambda: index.entries(EID) == 1)
            store(pub, [2], 1, 4, lost=True)  # the subscriber never sees this one
            store(pub, [3], None, 100)
            await wait_for(lambda: 3 in index.engine_hashes(EID))
            assert not index.trusted(EID)
            assert "gap" in index.untrusted_reason(EID)
            # The entries from before the gap are dropped: a missed removal would lie.
            assert index.engine_hashes(EID) == {3}
            # A cleared cache is fully known again: trusted at once.
            pub.publish([AllBlocksCleared()])
            await wait_for(lambda: index.trusted(EID))
            assert sub_of(manager).last_seq == pub.published - 1
    finally:
        await pub.aclose()


async def test_gap_is_filled_by_replay() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m", replay_port=0)
    pub.start()
    try:
        async with subscribed(pub) as (index, _):
            toks = store(pub, [1], None, 0)
            toks += store(pub, [2], 1, 4, lost=True)
            toks += store(pub, [3], 2, 8, lost=True)
            toks += store(pub, [4], 3, 12)
            keys = block_keys(toks, BS)
            await wait_for(lambda: index.match(keys, [EID]) == {EID: 4})
            assert index.trusted(EID)
    finally:
        await pub.aclose()


async def test_resync_window_ends_in_trust() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    try:
        async with subscribed(pub, resync_seconds=0.2) as (index, _):
            store(pub, [1], None, 0, lost=True)
            store(pub, [2], None, 4)
            await wait_for(lambda: 2 in index.engine_hashes(EID))
            await wait_for(lambda: index.trusted(EID))
    finally:
        await pub.aclose()


async def test_reconnect_after_the_publisher_restarts() -> None:
    first = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    port = first.port
    restarted: KVEventPublisher | None = None
    try:
        async with subscribed(first) as (index, manager):
            for i in range(5):
                store(first, [10 + i], None, 4 * i)
            await wait_for(lambda: index.entries(EID) == 5)
            await first.aclose()
            sub = sub_of(manager)
            await wait_for(lambda: not sub.connected)
            assert not index.trusted(EID)
            restarted = KVEventPublisher("127.0.0.1", port, "kv@t@m")
            await wait_for(lambda: sub.connected)
            # A restarted replica's cache is empty and its seq starts again at 0.
            await resync(restarted, index)
            store(restarted, [99], None, 0)
            await wait_for(lambda: index.engine_hashes(EID) == {99})
    finally:
        if restarted is not None:
            await restarted.aclose()


async def test_silent_publisher_is_distrusted_until_it_speaks() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    try:
        async with subscribed(pub, silence_seconds=0.1) as (index, manager):
            loop = asyncio.get_running_loop()
            manager.expect_events(EID, loop.time() + 1.0)  # picked after the last batch
            await wait_for(lambda: not index.trusted(EID))
            assert index.untrusted_reason(EID) == "silent publisher"
            store(pub, [1], None, 0)
            await wait_for(lambda: index.trusted(EID))
    finally:
        await pub.aclose()


# -- end to end with simulated replicas --------------------------------------------------------


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_precise_index_matches_the_replicas_after_eviction_pressure(encoding: str) -> None:
    config = SimConfig(
        speed=100.0, num_gpu_blocks=40, kv_events_port=0, kv_events_replay_port=0,
        kv_events_encoding=encoding,
    )
    async with start_replicas(2, config) as replicas:
        index = PreciseIndex(16)
        sources = [
            EventSource(endpoint_id_from_url(r.url), r.kv_events_address or "",
                        r.kv_events_replay_address)
            for r in replicas
        ]
        manager = KVEventsManager(
            index, sources, SubscriberSettings(tick_seconds=0.02), CollectorRegistry()
        )
        manager.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                # 3 conversations x 4 turns through 40-block caches: prompts grow to ~15
                # blocks, so turns evict each other's blocks.
                for turn in range(4):
                    for conv, rep in [(c, replicas[c % 2]) for c in range(3)]:
                        text = "".join(f"conv {conv} turn {t} words " * 12 for t in range(turn + 1))
                        body = {"model": "sim-model", "prompt": text, "max_tokens": 8}
                        reply = await client.post(rep.url + "/v1/completions", json=body)
                        assert reply.status_code == 200
            for rep, source in zip(replicas, sources, strict=True):
                cached = set(rep.engine.kv.cached_hashes())
                await wait_for(lambda s=source, c=cached: index.engine_hashes(s.endpoint_id) == c)
                assert index.trusted(source.endpoint_id)
                assert index.stats.orphans == 0
            assert sum(r.engine.kv.num_cached_blocks for r in replicas) > 0
            assert index.stats.removed > 0  # the pressure did evict
        finally:
            await manager.stop()


# -- a connection that dies without closing -------------------------------------------------------


class BlackHoleProxy:
    """A loopback TCP proxy whose open connections can go dead without closing (a peer that
    crashed or a network that dropped, as a half-open TCP connection looks from this side);
    connections made later are relayed again."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._server: asyncio.Server | None = None
        self._generation = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def kill_open_connections(self) -> None:
        self._generation += 1

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        self._writers += [writer, up_writer]
        generation = self._generation
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst, generation))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, generation: int
    ) -> None:
        while data := await reader.read(65536):
            if generation != self._generation:
                continue  # dead: bytes vanish, nothing is closed
            writer.write(data)
            await writer.drain()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_connection_that_dies_without_closing_is_detected_and_replaced() -> None:
    """A replica that crashed (or a network that dropped) without closing the TCP connection:
    the subscription must notice and reconnect, not wait on the dead connection for good."""
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    proxy = BlackHoleProxy(pub.port)
    address = await proxy.start()
    index = PreciseIndex(BS)
    manager = KVEventsManager(
        index,
        [EventSource(EID, address)],
        SubscriberSettings(tick_seconds=0.02, heartbeat_seconds=0.1),
        CollectorRegistry(),
    )
    manager.start()
    try:
        sub = sub_of(manager)
        await resync(pub, index)
        proxy.kill_open_connections()
        # Keep publishing: only a new connection can carry these.
        async with asyncio.timeout(10):
            while 99 not in index.engine_hashes(EID):
                store(pub, [99], None, 0)
                await asyncio.sleep(0.05)
        assert sub.connected
    finally:
        await manager.stop()
        await proxy.close()
        await pub.aclose()


async def test_a_failed_subscriber_is_reported_untrusted_until_it_resyncs() -> None:
    """A subscriber that failed is restarted with its entries dropped: the trust gauge says so."""
    pub = KVEventPublisher("127.0.0.1", 0, "kv@t@m")
    registry = CollectorRegistry()
    index = PreciseIndex(BS)
    manager = KVEventsManager(
        index, [EventSource(EID, pub.address)], SubscriberSettings(tick_seconds=0.02), registry
    )
    manager.start()

    def gauge() -> float | None:
        return registry.get_sample_value("prefixgate_kv_events_trusted", {"endpoint": EID})

    try:
        sub = sub_of(manager)
        await resync(pub, index)
        assert gauge() == 1

        async def fail(frames: object) -> None:
            raise RuntimeError("a bug")

        sub.on_message = fail  # type: ignore[method-assign]
        pub.publish([AllBlocksCleared()])
        await wait_for(lambda: index.untrusted_reason(EID) == "subscriber restarted")
        assert gauge() == 0
    finally:
        await manager.stop()
        await pub.aclose()
