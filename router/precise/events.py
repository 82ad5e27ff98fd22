"""Subscribing to vLLM's KV events: one ZMQ SUB per endpoint feeding the precise index.

Frames are ``[topic, seq, payload]`` (decoding: router.precise.event_codec).

Trust, per endpoint (an untrusted endpoint is scored from the approximate index instead):

- the stream is trusted once it is known complete: it started at seq 0, or a replay filled the
  gap, or the replica cleared its cache (``AllBlocksCleared``);
- a sequence gap asks the publisher's replay socket (vLLM's ``replay_endpoint``) for the missed
  batches; when that fails the endpoint's entries are dropped (a missed removal would make them
  lie) and it stays untrusted for ``resync_seconds`` while live events rebuild it;
- a seq going backwards is a restarted replica: its cache is empty, so are its entries;
- a lost connection, or a replica that answered requests without publishing anything within
  ``silence_seconds`` (see ``KVEventsManager.expect_events`` in router.precise.events_manager), is
  untrusted until a batch arrives in sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge
from zmq.utils.monitor import parse_monitor_message

from router.config.precise import KVEventsConfig
from router.precise.event_codec import (
    AppliedOp,
    Cleared,
    DecodeError,
    EventBatch,
    Removed,
    Stored,
    apply_batch,
    decode_batch,
    decode_event,
)
from router.precise.event_sources import EventSource, derive_sources
from router.precise.index import PreciseIndex

__all__ = [
    "BatchMirror", "Cleared", "DecodeError", "EndpointSubscriber", "EventBatch", "EventSource",
    "Removed", "Stored", "SubscriberMetrics", "SubscriberSettings", "apply_batch",
    "decode_batch", "decode_event", "derive_sources",
]

log = logging.getLogger("prefixgate.kv_events")
_MAX_DRAIN = 1024


class BatchMirror(Protocol):
    """Receives every batch as applied locally, in sequence order (a shared index)."""

    def batch(self, endpoint_id: str, seq: int, ts: float, ops: list[AppliedOp]) -> None: ...


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    """The ``precisePrefix.kvEvents`` config, and the polling knobs that are not configurable."""

    events: KVEventsConfig = field(default_factory=KVEventsConfig)
    tick_seconds: float = 0.1
    receive_hwm: int = 100_000
    # ZMTP heartbeats: a connection that died without closing (crashed host, dropped network)
    # is dropped after three silent intervals and reconnected; TCP alone would wait for good.
    heartbeat_seconds: float = 2.0


class SubscriberMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.batches = Counter(
            "prefixgate_kv_event_batches", "KV event batches applied.", ["endpoint"], registry=r
        )
        self.problems = Counter(
            "prefixgate_kv_event_problems",
            "KV event stream problems: gap, replayed, replay_failed, restart, decode_error, "
            "unmapped (a stored block whose parent is unknown), silent, disconnected.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.trusted = Gauge(
            "prefixgate_kv_events_trusted",
            "1 while the endpoint's precise index is trusted; 0 means approximate fallback.",
            ["endpoint"],
            registry=r,
        )
        self.entries = Gauge(
            "prefixgate_precise_index_blocks",
            "Blocks the precise index holds for the endpoint.",
            ["endpoint"],
            registry=r,
        )


class EndpointSubscriber:
    """The SUB (and replay DEALER) sockets of one endpoint and its sequence bookkeeping."""

    def __init__(
        self,
        source: EventSource,
        index: PreciseIndex,
        ctx: zmq.asyncio.Context,
        settings: SubscriberSettings,
        metrics: SubscriberMetrics,
        clock: Callable[[], float] = time.monotonic,
        mirror: BatchMirror | None = None,
    ) -> None:
        self.source = source
        self._mirror = mirror
        self.endpoint_id = source.endpoint_id
        self._index = index
        self._ctx = ctx
        self._settings = settings
        self._metrics = metrics
        self._batches = metrics.batches.labels(self.endpoint_id)  # counted every engine step
        self._clock = clock
        self.last_seq: int | None = None
        self.last_batch_at = -float("inf")
        self.connected = False
        self._resync_until: float | None = None
        self._expect: tuple[float, float] | None = None  # (since, deadline)
        # Set when the connection dropped or the publisher went silent: only a batch that
        # continues the sequence restores trust.
        self._need_batch = False
        index.set_trusted(self.endpoint_id, False, "no events yet")

    # -- trust ----------------------------------------------------------------------------

    def distrust(self, reason: str, stale: bool = False) -> None:
        if self._index.trusted(self.endpoint_id):
            log.warning("kv events %s: untrusted (%s)", self.endpoint_id, reason)
        self._index.set_trusted(self.endpoint_id, False, reason, stale)
        self._metrics.trusted.labels(self.endpoint_id).set(0)

    def _maybe_trust(self, now: float) -> None:
        if self._index.trusted(self.endpoint_id) or self.last_seq is None or self._need_batch:
            return
        if self._resync_until is not None and now < self._resync_until:
            return
        self._resync_until = None
        self._index.set_trusted(self.endpoint_id, True)
        self._metrics.trusted.labels(self.endpoint_id).set(1)

    def _problem(self, kind: str) -> None:
        self._metrics.problems.labels(self.endpoint_id, kind).inc()

    def expect_events(self, since: float) -> None:
        """A request finished here that must have stored blocks: events should follow soon."""
        if self.last_batch_at >= since or self._expect is not None:
            return
        self._expect = (since, self._clock() + self._settings.events.silence_seconds)

    def tick(self, now: float) -> None:
        """Periodic checks: silence deadlines, resync windows; refresh the gauges."""
        if self._expect is not None:
            since, deadline = self._expect
            if self.last_batch_at >= since:
                self._expect = None
            elif now >= deadline:
                self._expect = None
                self._problem("silent")
                self._need_batch = True
                self.distrust("silent publisher", stale=True)
        if self.connected:
            self._maybe_trust(now)
        self._metrics.entries.labels(self.endpoint_id).set(self._index.entries(self.endpoint_id))

    # -- messages -------------------------------------------------------------------------

    async def on_message(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._problem("decode_error")
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        # After a lost connection, a batch that does not continue the sequence may come from
        # a restarted replica as well as from a gap: assume the restart (the safe reading).
        resumed = self._need_batch and not self._continues(seq)
        if last is not None and (seq <= last or resumed):
            log.warning("kv events %s: seq %d after %d, replica restarted", self.endpoint_id,
                        seq, last)
            self._problem("restart")
            self._index.cleared(self.endpoint_id)
            self.last_seq = last = None
            self._resync_until = None
        expected = 0 if last is None else last + 1
        if seq > expected and not await self._recover(expected, seq):
            self._start_resync(seq)
        self._apply(seq, frames[2])

    def _continues(self, seq: int) -> bool:
        return self.last_seq is not None and seq == self.last_seq + 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._need_batch = False
        now = self._clock()
        self.last_batch_at = now
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            # The batch is lost for good: same as a gap that replay cannot fill.
            log.warning("kv events %s: undecodable batch %d: %s", self.endpoint_id, seq, exc)
            self._problem("decode_error")
            self._start_resync(seq + 1)
            return
        ops: list[AppliedOp] | None = None if self._mirror is None else []
        unmapped = apply_batch(self._index, self.endpoint_id, batch, ops)
        if self._mirror is not None and ops is not None:
            self._mirror.batch(self.endpoint_id, seq, batch.ts, ops)
        if unmapped:
            self._metrics.problems.labels(self.endpoint_id, "unmapped").inc(unmapped)
        if any(isinstance(e, Cleared) for e in batch.events):
            self._resync_until = None  # a cleared cache is fully known from here on
        self._batches.inc()
        self._maybe_trust(now)

    def _start_resync(self, seq: int) -> None:
        self._index.cleared(self.endpoint_id)
        self._resync_until = self._clock() + self._settings.events.resync_seconds
        self.distrust(f"sequence gap before {seq}; resyncing")

    async def _recover(self, start: int, until: int) -> bool:
        """Replay ``start .. until - 1`` from the publisher; True when all of it arrived."""
        self._problem("gap")
        self.distrust(f"sequence gap {start}..{until - 1}")
        if self.source.replay_address is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.source.replay_address)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._settings.events.replay_timeout_seconds):
                while self.last_seq is None or self.last_seq < until - 1:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 3 or not frames[2]:
                        break
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    expected = 0 if self.last_seq is None else self.last_seq + 1
                    if seq < expected:
                        continue
                    if seq > expected:
                        break
                    self._apply(seq, frames[2])
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("kv events %s: replay failed: %r", self.endpoint_id, exc)
        finally:
            dealer.close(linger=0)
        done = self.last_seq is not None and self.last_seq >= until - 1
        self._problem("replayed" if done else "replay_failed")
        return done

    def on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._need_batch = True
            self._problem("disconnected")
            self.distrust("publisher disconnected", stale=True)

    # -- the loop -------------------------------------------------------------------------

    async def _drain(self, sub: zmq.Socket[bytes]) -> None:
        # Everything queued now (a busy fleet publishes a batch per engine step; a lagging
        # index routes on the past), read from a plain socket sharing the asyncio one's handle:
        # an asyncio receive builds a future per batch, which cost more than most batches.
        for _ in range(_MAX_DRAIN):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self.on_message(frames)
            await asyncio.sleep(0)  # a large batch is CPU: let requests through

    async def run(self) -> None:
        s = self._settings
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, s.receive_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        heartbeat_ms = max(1, int(s.heartbeat_seconds * 1000))
        sub.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
        if "[" in self.source.address:
            sub.setsockopt(zmq.IPV6, 1)
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        sub.setsockopt(zmq.SUBSCRIBE, s.events.topic.encode())
        sub.connect(self.source.address)
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # never closed: sub owns it
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_tick = self._clock()
        try:
            while True:
                ready = dict(await poller.poll(int(s.tick_seconds * 1000)))
                if monitor in ready:
                    self.on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    await self._drain(plain)
                now = self._clock()
                if now - last_tick >= s.tick_seconds:
                    self.tick(now)
                    last_tick = now
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
