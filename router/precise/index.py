"""The precise prefix index: which blocks each replica really holds, fed by its KV events.

Engine block hashes cannot be reproduced by the gateway (vLLM hashes with sha256 of a pickle, a
per-process seed, extra keys), so every stored block is mapped to the gateway's own *key*,
computed from the block's token ids, its extra keys (adapter, salt, media: router/precise/keys.py)
and its parent's key (:func:`block_keys`). The request side computes the same chain from the
request's tokens, adapter and salt, so a lookup walks keys, never engine hashes.

Per endpoint the index keeps ``engine hash -> key`` (to apply ``BlockRemoved``) and a count of
engine hashes per key (two engine hashes can share a key: a vLLM that does not publish extra
keys stores a salted block under the key of the unsalted one), and how many blocks an engine
hash is cached in (vLLM does not de-duplicate: each copy is stored and removed with an event of
its own, and the hash is held until its last copy goes). Holder bitmasks per key make the
chain walk a few integer operations per block, as in the approximate index.

Speculative entries: right after a pick, the request's keys are marked as held by the chosen
endpoint for a short TTL, so the rest of a same-prefix burst follows it before the engine has
computed (and announced) the blocks (router/precise/speculation.py).

Memory is bounded: per endpoint at most ``max_blocks`` mappings (a consistent stream never holds
more than the replica's ``num_gpu_blocks``; past the bound the oldest are dropped and counted),
a bounded memory of recently removed hashes (a later ``BlockStored`` may name one as its parent),
and a bounded number of speculative keys.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from router.precise.keys import KEY_SEED, BlockExtras, block_keys
from router.precise.speculation import Speculation, SpeculativeEntries

__all__ = ["KEY_SEED", "EngineHash", "IndexStats", "PreciseIndex", "block_keys"]

EngineHash = int | bytes
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BLOCKS = 1 << 20
DEFAULT_RECENT_REMOVED = 1 << 14
DEFAULT_MAX_SPECULATIVE = 1 << 20
# Adapter names learnt from events: a fleet loads a few dozen; the bound only guards memory.
MAX_ADAPTERS = 4096


@dataclass(slots=True)
class _Endpoint:
    bit: int
    to_key: dict[EngineHash, int] = field(default_factory=dict)
    # Copies of an engine hash beyond the first: vLLM may cache one hash in several blocks.
    copies: dict[EngineHash, int] = field(default_factory=dict)
    key_refs: dict[int, int] = field(default_factory=dict)
    recent: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)
    trusted: bool = False
    reason: str = "no events yet"
    # Untrusted because the stream itself looks broken (silent, disconnected), not because this
    # gateway is still catching up with it: a shared view cannot vouch for it either.
    stale: bool = False
    capacity: int = DEFAULT_MAX_BLOCKS


@dataclass(slots=True)
class IndexStats:
    """Counters the subscriber exports as metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    unknown_removals: int = 0
    overflow: int = 0
    block_size_mismatch: int = 0


class PreciseIndex:
    """Event-fed block index per endpoint, with speculative entries; event-loop only."""

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        recent_removed: int = DEFAULT_RECENT_REMOVED,
        max_speculative: int = DEFAULT_MAX_SPECULATIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        self.block_size = block_size
        self._max_blocks = max_blocks
        self._recent_limit = max(0, recent_removed)
        self._eps: dict[str, _Endpoint] = {}
        self._holders: dict[int, int] = {}
        self._spec = SpeculativeEntries(max_speculative, clock)
        self._adapters: set[str] = set()
        self.stats = IndexStats()

    # -- endpoints and trust ------------------------------------------------------------

    def _ep(self, endpoint_id: str) -> _Endpoint:
        ep = self._eps.get(endpoint_id)
        if ep is None:
            used = {e.bit for e in self._eps.values()}
            bit = next(1 << i for i in range(len(used) + 1) if (1 << i) not in used)
            ep = _Endpoint(bit, capacity=self._max_blocks)
            self._eps[endpoint_id] = ep
        return ep

    def set_trusted(
        self, endpoint_id: str, trusted: bool, reason: str = "", stale: bool = False
    ) -> None:
        ep = self._ep(endpoint_id)
        ep.trusted = trusted
        ep.reason = "" if trusted else reason
        ep.stale = stale and not trusted

    def catching_up(self, endpoint_id: str) -> bool:
        """Untrusted only for lack of history (late start, gap, restart), not a broken stream."""
        ep = self._eps.get(endpoint_id)
        return ep is None or (not ep.trusted and not ep.stale)

    def trusted(self, endpoint_id: str) -> bool:
        ep = self._eps.get(endpoint_id)
        return ep is not None and ep.trusted

    def untrusted_reason(self, endpoint_id: str) -> str:
        ep = self._eps.get(endpoint_id)
        return "unknown endpoint" if ep is None else ep.reason

    def set_capacity(self, endpoint_id: str, blocks: int) -> None:
        """Bound an endpoint's mappings (from its reported ``num_gpu_blocks``, with slack)."""
        ep = self._ep(endpoint_id)
        ep.capacity = max(1, min(blocks, self._max_blocks))
        self._trim(endpoint_id, ep)

    def capacity(self, endpoint_id: str) -> int:
        ep = self._eps.get(endpoint_id)
        return ep.capacity if ep is not None else self._max_blocks

    # -- events -------------------------------------------------------------------------

    def saw_adapter(self, name: str) -> None:
        """A replica stored blocks for the LoRA adapter ``name`` (its events' ``lora_name``)."""
        if len(self._adapters) < MAX_ADAPTERS:
            self._adapters.add(name)

    def is_adapter(self, model: str) -> bool:
        """Whether events have shown ``model`` to be a LoRA adapter's name."""
        return model in self._adapters

    def stored(
        self,
        endpoint_id: str,
        block_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        extras: BlockExtras | None = None,
    ) -> bool:
        """Apply a ``BlockStored``; False when it cannot be mapped (unknown parent, bad size)."""
        keys = self.stored_keys(endpoint_id, block_hashes, parent, token_ids, block_size, extras)
        return keys is not None

    def stored_keys(
        self,
        endpoint_id: str,
        block_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        extras: BlockExtras | None = None,
    ) -> list[int] | None:
        """:meth:`stored`, returning the keys the blocks were mapped to (None: not mapped)."""
        ep = self._ep(endpoint_id)
        if block_size != self.block_size:
            self.stats.block_size_mismatch += 1
            return None
        if len(token_ids) < len(block_hashes) * block_size:
            self.stats.orphans += 1
            return None
        if parent is None:
            parent_key = KEY_SEED
        else:
            found = ep.to_key.get(parent)
            if found is None:
                found = ep.recent.get(parent)
            if found is None:
                self.stats.orphans += 1
                return None
            parent_key = found
        keys = block_keys(token_ids, block_size, parent_key, len(block_hashes), extras)
        for engine_hash, key in zip(block_hashes, keys, strict=True):
            self._add(ep, engine_hash, key)
        self.stats.stored += len(keys)
        self._trim(endpoint_id, ep)
        return keys

    def learn_parent(self, endpoint_id: str, engine_hash: EngineHash, key: int) -> None:
        """Remember a block's key learnt elsewhere (a shared index), so that later blocks
        naming it as parent can be mapped; it is not counted as held."""
        ep = self._eps.get(endpoint_id)
        if ep is not None and engine_hash not in ep.to_key:
            self._remember_removed(ep, engine_hash, key)

    def _add(self, ep: _Endpoint, engine_hash: EngineHash, key: int) -> None:
        old = ep.to_key.get(engine_hash)
        if old == key:
            # Another block cached under the same hash (vLLM does not de-duplicate): it takes
            # a BlockRemoved of each copy to drop the hash.
            ep.copies[engine_hash] = ep.copies.get(engine_hash, 0) + 1
            return
        if old is not None:
            ep.copies.pop(engine_hash, None)
            self._unref(ep, old)
        ep.to_key[engine_hash] = key
        ep.recent.pop(engine_hash, None)
        refs = ep.key_refs.get(key, 0)
        ep.key_refs[key] = refs + 1
        if not refs:
            self._holders[key] = self._holders.get(key, 0) | ep.bit

    def _unref(self, ep: _Endpoint, key: int) -> None:
        refs = ep.key_refs.get(key, 0) - 1
        if refs > 0:
            ep.key_refs[key] = refs
            return
        ep.key_refs.pop(key, None)
        mask = self._holders.get(key, 0) & ~ep.bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def removed(self, endpoint_id: str, block_hashes: Iterable[EngineHash]) -> None:
        ep = self._ep(endpoint_id)
        for engine_hash in block_hashes:
            copies = ep.copies.get(engine_hash, 0)
            if copies:  # another copy of the block is still cached
                if copies > 1:
                    ep.copies[engine_hash] = copies - 1
                else:
                    del ep.copies[engine_hash]
                self.stats.removed += 1
                continue
            key = ep.to_key.pop(engine_hash, None)
            if key is None:
                self.stats.unknown_removals += 1
                continue
            self._unref(ep, key)
            self._remember_removed(ep, engine_hash, key)
            self.stats.removed += 1

    def _remember_removed(self, ep: _Endpoint, engine_hash: EngineHash, key: int) -> None:
        if not self._recent_limit:
            return
        ep.recent[engine_hash] = key
        if len(ep.recent) > self._recent_limit:
            ep.recent.popitem(last=False)

    def cleared(self, endpoint_id: str) -> None:
        """Forget everything the endpoint held (``AllBlocksCleared``, or a restart)."""
        ep = self._ep(endpoint_id)
        for key in ep.key_refs:
            mask = self._holders.get(key, 0) & ~ep.bit
            if mask:
                self._holders[key] = mask
            else:
                self._holders.pop(key, None)
        ep.to_key.clear()
        ep.copies.clear()
        ep.key_refs.clear()
        ep.recent.clear()
        self.stats.cleared += 1

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint that left the pool, speculative entries included."""
        if endpoint_id not in self._eps:
            return
        self.cleared(endpoint_id)
        del self._eps[endpoint_id]
        self._spec.forget(endpoint_id)

    def _trim(self, endpoint_id: str, ep: _Endpoint) -> None:
        while len(ep.to_key) > ep.capacity:
            engine_hash = next(iter(ep.to_key))
            ep.copies.pop(engine_hash, None)
            self._unref(ep, ep.to_key.pop(engine_hash))
            self.stats.overflow += 1

    # -- speculative entries ------------------------------------------------------------

    def speculate(self, endpoint_id: str, keys: Sequence[int], ttl: float) -> Speculation | None:
        """Mark ``keys`` as about to be held by ``endpoint_id`` for ``ttl`` seconds; the handle
        takes them back (``withdraw``)."""
        if not keys or ttl <= 0:
            return None
        return self._spec.add(endpoint_id, self._ep(endpoint_id).bit, keys, ttl)

    def withdraw(self, speculation: Speculation) -> None:
        """Drop a pick's speculative entries: its attempt failed before its first byte."""
        self._spec.withdraw(speculation)

    def settle(self, endpoint_id: str, keys: Sequence[int]) -> None:
        """The request that speculated ``keys`` on ``endpoint_id`` has been prefilled."""
        self._spec.settle(endpoint_id, keys)

    # -- lookups ------------------------------------------------------------------------

    def match(
        self,
        keys: Sequence[int],
        endpoint_ids: Collection[str],
        speculative: bool = True,
        confirmed: bool = True,
        settled_only: bool = False,
    ) -> dict[str, int]:
        """Per endpoint, the number of leading ``keys`` it holds (0 when none).

        ``confirmed=False`` counts speculative entries only (an endpoint whose events this
        gateway does not follow yet, but which it just picked); ``settled_only`` counts only
        speculative entries whose request has been prefilled."""
        result = dict.fromkeys(endpoint_ids, 0)
        bits = {eid: self._eps[eid].bit for eid in endpoint_ids if eid in self._eps}
        active = 0
        for bit in bits.values():
            active |= bit
        spec = self._spec.current(settled_only) if speculative else {}
        holders = self._holders if confirmed else {}
        for i, key in enumerate(keys):
            held = (holders.get(key, 0) | spec.get(key, 0)) & active
            if held != active:
                for eid, bit in bits.items():
                    if active & ~held & bit:
                        result[eid] = i
                active = held
                if not active:
                    return result
        for eid, bit in bits.items():
            if active & bit:
                result[eid] = len(keys)
        return result

    # -- inspection -----------------------------------------------------------------------

    def engine_hashes(self, endpoint_id: str) -> set[EngineHash]:
        ep = self._eps.get(endpoint_id)
        return set(ep.to_key) if ep is not None else set()

    def keys(self, endpoint_id: str) -> set[int]:
        ep = self._eps.get(endpoint_id)
        return set(ep.key_refs) if ep is not None else set()

    def entries(self, endpoint_id: str) -> int:
        ep = self._eps.get(endpoint_id)
        return len(ep.to_key) if ep is not None else 0

    def speculative_entries(self) -> int:
        return self._spec.count

    def endpoints(self) -> list[str]:
        return list(self._eps)
