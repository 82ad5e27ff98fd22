"""The updates a gateway queues for the shared precise index, and their packing for Redis.

Each is shipped by :class:`~router.precise.shared_index.SharedPreciseIndex` as one script call:
an event batch (``APPLY``), the speculative entries of a pick (``SPECULATE``), or the purge of
an endpoint that left, or of a garbage map's next step (``FORGET``, ``GC``). Keys and engine
hashes travel packed, 8 little-endian bytes each, which the scripts cut apart.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.precise.event_codec import AppliedOp, Cleared
from router.precise.index import EngineHash

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class EventBatch:
    seq: int
    ts: float
    ops: list[AppliedOp]
    capacity: int


@dataclass(frozen=True, slots=True)
class Speculation:
    keys: bytes
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class Purge:
    pass


Update = EventBatch | Speculation | Purge
UpdateKey = tuple[str, str, int]  # (kind, endpoint id, sequence of the put or last key)


def hash_id(engine_hash: EngineHash) -> bytes:
    """An engine hash as 8 bytes: ints as they are (mod 2**64), bytes hashed (sha256 ones)."""
    if isinstance(engine_hash, int):
        return (engine_hash & _MASK64).to_bytes(8, "little")
    return xxhash.xxh64_digest(engine_hash)


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}Q", *keys)


def pack_ids(hashes: Sequence[EngineHash]) -> bytes:
    return b"".join(hash_id(h) for h in hashes)


def update_cost(key: UpdateKey, item: Update) -> int:
    """Roughly the bytes an update holds, for the queue's bounds (pending and per batch)."""
    if isinstance(item, Speculation):
        return len(item.keys) + 64
    if isinstance(item, EventBatch):
        blocks = (op.block_hashes for op in item.ops if not isinstance(op, Cleared))
        return 64 + sum(24 * len(b) for b in blocks)
    return 64
