"""Decoding vLLM's KV event batches, and applying them to the precise index.

Wire format, as vLLM's ZMQ publisher sends it: frames ``[topic, seq, payload]``, ``seq`` 8
bytes big-endian, ``payload`` msgpack ``[ts, [events], data_parallel_rank]``; events either
tagged arrays (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, ...]``, trailing defaults may be omitted) or maps with a
``"type"`` key. Both are accepted, and block hashes may be integers or bytes. Events for other
media than the GPU (CPU offloading) are ignored: a prefix-cache hit reuses GPU blocks.

A stored block's key folds in the extra keys vLLM hashed it with (router/precise/keys.py):
``extra_keys`` (one entry per block, newer vLLM) when the event has them, else its adapter's
``lora_name`` on every block. An adapter named by ``lora_id`` only (older vLLM) keys its blocks
apart from every request's, since the gateway cannot tell which adapter that number is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from router.precise.index import EngineHash, PreciseIndex
from router.precise.keys import encode_extra

_GPU_MEDIA = (None, "GPU", "gpu")
# No request's extra keys hold a nil: blocks keyed with this are matched by none.
_UNMATCHABLE = encode_extra([None])


class DecodeError(ValueError):
    """A message that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block, vLLM's extra keys (an array, or nil for none); None when the event has none.
    extra_keys: list[Any] | None = None


def block_extras(event: Stored) -> list[bytes | None] | None:
    """Per block, its extra keys as its key folds them in; None for blocks that have none."""
    n = len(event.block_hashes)
    raw = event.extra_keys
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != n:
            return [_UNMATCHABLE] * n  # which block has which cannot be told
        if raw.count(None) == n:  # what vLLM sends for a request without any
            return None
        return [_extra(e) for e in raw]
    if event.lora_name is not None:
        return [encode_extra([event.lora_name])] * n
    if event.lora_id is not None:
        return [encode_extra([None, event.lora_id])] * n
    return None


def _extra(entry: Any) -> bytes | None:
    if entry is None or isinstance(entry, list):
        return None if not entry else encode_extra(entry)
    return encode_extra([None, entry])  # not vLLM's shape (an array): matched by no request


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[EngineHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Mapped:
    """A ``Stored`` (GPU) as applied to the local index: its blocks with their keys."""

    block_hashes: list[EngineHash]
    keys: list[int]


# What a batch did to the local index, in order, for mirroring it elsewhere (a shared index):
# a Stored here is one the local index could not map (its parent is unknown locally).
AppliedOp = Mapped | Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list) or not all(isinstance(h, (int, bytes)) for h in value):
        raise DecodeError("block_hashes must be a list of integers or bytes")
    return value


def decode_event(raw: Any) -> Event | None:
    """One event in either encoding; None for an event type this gateway does not use."""
    # Arrays first: vLLM sends them, and the Mapping check (an ABC) costs a one-block event,
    # what a busy replica publishes every engine step, a fifth of its decoding.
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise DecodeError("an event must not be an empty array")
        tag = raw[0]
        names = _FIELDS.get(tag) if isinstance(tag, str) else None
        fields = dict(zip(names or (), raw[1:], strict=False))
    elif isinstance(raw, Mapping):
        tag = raw.get("type")
        fields = dict(raw)
    else:
        raise DecodeError(f"an event must be a tagged array or a map, got {type(raw).__name__}")
    if tag == "BlockStored":
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        size = fields.get("block_size")
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise DecodeError("parent_block_hash must be an integer, bytes or nil")
        if not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
            raise DecodeError("BlockStored needs token_ids and a positive block_size")
        return Stored(
            _hashes(fields.get("block_hashes")), parent, tokens, size,
            fields.get("lora_id"), fields.get("medium"), fields.get("lora_name"),
            fields.get("extra_keys"),
        )
    if tag == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes")), fields.get("medium"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack ``[ts, [events], dp_rank]`` (or the same as a map); raises DecodeError."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise DecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise DecodeError("an event batch must be [ts, events, dp_rank]")
    if not isinstance(events, list) or not isinstance(ts, (int, float)):
        raise DecodeError("an event batch needs a numeric ts and a list of events")
    decoded = [e for e in (decode_event(r) for r in events) if e is not None]
    return EventBatch(float(ts), decoded, rank if isinstance(rank, int) else None)


def apply_batch(
    index: PreciseIndex,
    endpoint_id: str,
    batch: EventBatch,
    applied: list[AppliedOp] | None = None,
) -> int:
    """Apply a batch's events in order; the number of events that could not be mapped.

    With ``applied``, appends what was done (see :data:`AppliedOp`)."""
    failed = 0
    out: list[AppliedOp] = [] if applied is None else applied
    for event in batch.events:
        if isinstance(event, Stored):
            # Offloaded copies (CPU, disk) are not what a prefix-cache hit on the GPU reuses.
            if event.medium not in _GPU_MEDIA:
                continue
            if isinstance(event.lora_name, str):
                index.saw_adapter(event.lora_name)
            keys = index.stored_keys(
                endpoint_id, event.block_hashes, event.parent, event.token_ids, event.block_size,
                block_extras(event),
            )
            if keys is None:
                failed += 1
                if event.block_size == index.block_size:
                    out.append(event)
            else:
                out.append(Mapped(event.block_hashes, keys))
        elif isinstance(event, Removed):
            if event.medium in _GPU_MEDIA:
                index.removed(endpoint_id, event.block_hashes)
                out.append(event)
        else:
            index.cleared(endpoint_id)
            out.append(event)
    return failed
