"""KV-cache events published the way vLLM publishes them (its ZMQ publisher and replay socket).

A ZMQ PUB socket bound on the replica's events port sends one message per engine step that
changed the cache: frames ``[topic, seq, payload]`` where ``topic`` is ``kv@<host:port>@<model>``,
``seq`` an 8-byte big-endian counter starting at 0 (a restarted replica starts again at 0), and
``payload`` a msgpack ``[ts, [event, ...], data_parallel_rank]``. Events come in two encodings,
as vLLM's have over its versions: tagged arrays (``["BlockStored", hashes, parent, ...]``) or
maps with a ``"type"`` key.

An optional ROUTER socket answers replay requests like vLLM's: a client sends the first sequence
number it misses (8 bytes, big-endian) and receives ``[seq, payload]`` for every buffered batch
from there on, then ``[-1, b""]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

Encoding = Literal["array", "map"]
ENCODINGS: tuple[Encoding, ...] = ("array", "map")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
MEDIUM = "GPU"

log = logging.getLogger("benchmarks.sim.kv_events")


@dataclass(slots=True)
class BlockStored:
    """Full blocks that became findable, in chain order; ``token_ids`` covers all of them."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    # Per block, the extra keys vLLM hashed it with (newer vLLM sends them: the request's
    # cache_salt on its first block, else nil).
    extra_keys: list[list[Any] | None] | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int] = field(default_factory=list)
    medium: str | None = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: KVEvent, encoding: Encoding) -> list[Any] | dict[str, Any]:
    """One event as vLLM's msgspec structs serialise it (array-tagged or map with "type")."""
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": event.extra_keys,
        }
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_hashes, "medium": event.medium}
    else:
        fields = {}
    name = type(event).__name__
    if encoding == "map":
        return {"type": name, **fields}
    return [name, *fields.values()]


def encode_batch(
    events: Sequence[KVEvent], encoding: Encoding, ts: float | None = None, dp_rank: int = 0
) -> bytes:
    """The msgpack payload of one message: ``[ts, [events], data_parallel_rank]``."""
    body = [encode_event(e, encoding) for e in events]
    packed: bytes = msgpack.packb([time.time() if ts is None else ts, body, dp_rank])
    return packed


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KVEventPublisher:
    """PUB (and optional replay ROUTER) sockets of one replica; sends never block the loop.

    ``port`` 0 binds an ephemeral port (see ``address``). PUB sends are non-blocking: past the
    high-water mark ZMQ drops messages, which subscribers see as a sequence gap, as with vLLM.
    """

    def __init__(
        self,
        host: str,
        port: int,
        topic: str,
        encoding: Encoding = "array",
        replay_port: int | None = None,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown KV events encoding {encoding!r}")
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        # PUB is a plain socket: a non-blocking send either queues at once or raises Again.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] = self._sync_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        if ":" in host:
            self._pub.setsockopt(zmq.IPV6, 1)
        self.port = self._bind(self._pub, host, port)
        self.address = _tcp(host, self.port)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_address: str | None = None
        if replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            rport = self._bind(self._replay, host, replay_port)
            self.replay_address = _tcp(host, rport)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.published = 0

    @staticmethod
    def _bind(sock: zmq.Socket[Any], host: str, port: int) -> int:
        if port:
            sock.bind(_tcp(host, port))
            return port
        endpoint = sock.bind_to_random_port(_tcp(host, 0).rsplit(":", 1)[0])
        return int(endpoint)

    def start(self) -> None:
        """Serve replay requests (needs a running loop); a no-op without a replay socket."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="sim-kv-events-replay"
            )

    def publish(self, events: Sequence[KVEvent], *, lost: bool = False) -> None:
        """Send one batch (one engine step's events) with the next sequence number.

        ``lost`` keeps the batch for replay but does not send it: a dropped message, for
        fault-injection tests.
        """
        if not events:
            return
        payload = encode_batch(events, self.encoding)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.published += 1
        if lost:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("malformed replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    reply = [client, b"", seq.to_bytes(8, "big"), payload]
                    await self._replay.send_multipart(reply)
            await self._replay.send_multipart([client, b"", END_SEQ, b""])

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
