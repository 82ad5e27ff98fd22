"""Connects precise prefix routing to the scheduler: tokenize, look up, speculate, predict.

:class:`PreciseTracker` is a scheduler producer and pick observer. ``RoutingRequest`` carries no
request body, so :class:`PreciseRouter` (the :class:`Router` every front door uses) hands the
parsed body to the tracker, which keeps per-request state in a bounded side table keyed by the
request id: the prompt's block keys, the match per endpoint, and what was predicted at the pick
(for :mod:`router.api.prediction`). Entries leave the table when the prediction is read, or as the
oldest once the table is full (requests shed before they were routed).

With a shared index in Redis (router/precise/shared_index.py) ``produce`` also asks Redis, once per
request, and the scores merge both views: an endpoint this replica trusts is never scored below
what its local index knows; one it does not trust only because it is still catching up (late
start, gap, restart) is scored from Redis when Redis trusts it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.config.model import GatewayConfig, PluginConfig
from router.config.precise import PrecisePrefixConfig
from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.precise.extras import NO_EXTRAS, KeyExtras, key_extras
from router.precise.index import PreciseIndex
from router.precise.keys import request_keys
from router.precise.shared_index import RemoteMatch, SharedPreciseIndex
from router.precise.speculation import Speculation
from router.precise.tokenizers import (
    TokenizeInput,
    Tokenizer,
)
from router.protocol import anthropic, responses_api
from router.protocol.parsing import ParsedRequest
from router.scheduling.routing import Prepared, Router

SCORER_TYPE = "precise-prefix-cache-scorer"
DEFAULT_MAX_REQUESTS = 4096
# Hashing ~2K blocks costs about a millisecond: past that it goes to a thread.
_THREAD_ABOVE_TOKENS = 32_768


@dataclass(slots=True)
class PreciseState:
    """One request's precise-routing facts (see the module doc)."""

    source: TokenizeInput | None
    extras: KeyExtras = NO_EXTRAS  # adapter and salt, folded into the keys
    num_tokens: int = 0
    keys: list[int] = field(default_factory=list)
    # Leading blocks per endpoint: at scoring (what routing used); at the pick, by events and
    # finished prefills only (confirmed), and with every speculative entry too (expected: what
    # the index predicts the replica will hit).
    hits: dict[str, int] = field(default_factory=dict)
    confirmed: dict[str, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    trusted: frozenset[str] = frozenset()
    # Trusted through the shared index only (this replica's own stream is catching up).
    shared_only: frozenset[str] = frozenset()
    remote: dict[str, RemoteMatch] = field(default_factory=dict)
    picked_at: float | None = None
    # The speculative entries each pick made, per endpoint: withdrawn should it fail.
    speculated: dict[str, Speculation] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreciseSettings:
    """The ``precisePrefix`` config, and how many requests' states to keep (not configurable)."""

    config: PrecisePrefixConfig = field(default_factory=PrecisePrefixConfig)
    max_requests: int = DEFAULT_MAX_REQUESTS


class PreciseTracker:
    """Producer + pick and unpick observer for the precise index (see the module doc)."""

    def __init__(
        self,
        index: PreciseIndex,
        tokenizer: Tokenizer,
        settings: PreciseSettings,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedPreciseIndex | None = None,
    ) -> None:
        self.index = index
        self.shared = shared
        self.tokenizer = tokenizer
        self.settings = settings
        self._clock = clock
        self._base_models = frozenset(settings.config.base_models)
        self._states: OrderedDict[int, PreciseState] = OrderedDict()

    def attach(self, serial: int, parsed: ParsedRequest) -> None:
        """Keep the request's tokenizer input under its ``RoutingRequest.serial``."""
        size = len(parsed.body)
        if parsed.api == "messages" or parsed.api == "responses":
            # Tokenized as the chat request vLLM turns it into.
            convert = anthropic.to_chat if parsed.api == "messages" else responses_api.to_chat
            messages, tools = convert(parsed.payload)
            chat = {"messages": messages, "tools": tools}
            source = TokenizeInput("chat", parsed.model, chat, size)
        else:
            source = TokenizeInput(parsed.api, parsed.model, parsed.payload, size)
        extras = key_extras(
            source, parsed.payload, self._base_models, self.index.is_adapter, parsed.api
        )
        if extras is None:  # keys that could not be the engine's: left to the approximate index
            return
        self._states[serial] = PreciseState(source, extras)
        self._states.move_to_end(serial)
        while len(self._states) > self.settings.max_requests:
            self._states.popitem(last=False)

    def state(self, serial: int) -> PreciseState | None:
        return self._states.get(serial)

    def finish(self, serial: int) -> PreciseState | None:
        """The request's state, removed from the table (read once, when its usage is known)."""
        return self._states.pop(serial, None)

    async def _keys(self, tokens: Sequence[int], extras: KeyExtras) -> list[int]:
        s = self.settings.config
        args = (tokens, s.block_size, s.max_blocks_per_request, extras.lora_name, extras.cache_salt)
        if len(tokens) < _THREAD_ABOVE_TOKENS:
            return request_keys(*args)
        return await asyncio.to_thread(request_keys, *args)

    async def produce(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        state = self._states.get(request.serial)
        if state is None or state.source is None or not endpoints:
            return
        source, state.source = state.source, None  # the body is not needed past this point
        tokens = await self.tokenizer.tokenize(source, endpoints)
        if tokens is None:
            return
        state.num_tokens = len(tokens)
        state.keys = await self._keys(tokens, state.extras)
        state.trusted = frozenset(e.id for e in endpoints if self.index.trusted(e.id))
        if self.shared is not None and state.keys:
            remote = await self.shared.lookup(state.keys, [e.id for e in endpoints])
            if remote:
                state.remote = remote
                state.shared_only = frozenset(
                    eid for eid, r in remote.items()
                    if r.trusted and eid not in state.trusted and self.index.catching_up(eid)
                )
                state.trusted |= state.shared_only

    def _match(self, state: PreciseState, ids: Sequence[str], speculative: bool) -> dict[str, int]:
        """Local and shared views merged (see the module doc)."""
        local = [eid for eid in ids if eid not in state.shared_only]
        hits = self.index.match(state.keys, local, speculative)
        shared = [eid for eid in ids if eid in state.shared_only]
        if shared and speculative:
            hits.update(self.index.match(state.keys, shared, confirmed=False))
        for eid in ids:
            r = state.remote.get(eid)
            if r is not None:
                remote = r.held if speculative else (r.confirmed if r.trusted else 0)
                hits[eid] = max(hits.get(eid, 0), remote)
        return hits

    def _match_computed(self, state: PreciseState, endpoint_id: str) -> dict[str, int]:
        """Blocks announced by events, or computed by a prefill that has finished on the
        endpoint (its events may still be on the way): what the replica certainly holds."""
        if endpoint_id in state.shared_only:
            return self._match(state, [endpoint_id], speculative=False)
        # One walk over both kinds of local evidence (a run may start on one and end on the
        # other); it covers the events-only walk, so only a shared view can add to it.
        held = self.index.match(state.keys, [endpoint_id], settled_only=True)[endpoint_id]
        remote = state.remote.get(endpoint_id)
        if remote is not None and remote.trusted:
            held = max(held, remote.confirmed)
        return {endpoint_id: held}

    def prefilled(self, serial: int, endpoint_id: str) -> None:
        """The request's first byte came back: its blocks are computed on the endpoint."""
        state = self._states.get(serial)
        if state is not None and state.keys:
            self.index.settle(endpoint_id, state.keys)

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None:
        state = self._states.get(request.serial)
        if state is None:
            return
        first_pick = state.picked_at is None
        state.picked_at = self._clock()
        if state.keys:
            # What the replica should hit, before this pick's own speculation.
            state.confirmed.update(self._match_computed(state, endpoint_id))
            scored = state.hits.get(endpoint_id) if first_pick else None
            if scored is not None:
                # Matched by scores() just before this pick, with no suspension in between
                # (a retry's pick comes later: it is matched again).
                state.expected[endpoint_id] = scored
            else:
                state.expected.update(self._match(state, [endpoint_id], speculative=True))
            ttl = self.settings.config.speculative_ttl_seconds
            speculation = self.index.speculate(endpoint_id, state.keys, ttl)
            if speculation is not None:
                state.speculated[endpoint_id] = speculation
            if self.shared is not None:
                self.shared.speculated(endpoint_id, state.keys, ttl)

    def on_unpick(self, request: RoutingRequest, endpoint_id: str) -> None:
        """The pick's attempt failed before its first byte: its speculative entries go now,
        not at their TTL, so the rest of a burst stops following them. Entries of other
        requests, and what the endpoint's events announced, stay."""
        state = self._states.get(request.serial)
        if state is not None:
            speculation = state.speculated.pop(endpoint_id, None)
            if speculation is not None:
                self.index.withdraw(speculation)

    def held_share(self, serial: int, endpoint_id: str) -> float | None:
        """The share of the prompt's blocks a trusted endpoint held when the request was
        scored; None when precise scores were not computed for it."""
        state = self._states.get(serial)
        if state is None or not state.keys or endpoint_id not in state.trusted:
            return None
        held = state.hits.get(endpoint_id)
        return None if held is None else held / len(state.keys)

    def scores(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[float] | None:
        """Per endpoint the held share of the prompt's blocks; None without precise data.

        Endpoints whose event stream is not trusted get the approximate index's share.
        """
        state = self._states.get(request.serial)
        if state is None or not state.keys:
            return None
        # Matched here, not in produce: scoring, picking and on_pick run without a suspension
        # point in between, so each request of a burst sees the picks made before it.
        trusted = [e.id for e in endpoints if e.id in state.trusted]
        state.hits = self._match(state, trusted, speculative=True)
        total = len(state.keys)
        approx_total = len(request.block_hashes)
        out = []
        for e in endpoints:
            if e.id in state.trusted:
                out.append(state.hits.get(e.id, 0) / total)
            elif approx_total:
                out.append(request.prefix_hits.get(e.id, 0) / approx_total)
            else:
                out.append(0.0)
        return out


class PreciseRouter(Router):
    """The shared :class:`Router`, plus handing each parsed body to the precise tracker."""

    reads_payload = True

    def __init__(self, *args: Any, tracker: PreciseTracker, **kwargs: Any) -> None:
        # Router's own arguments pass through untouched, whatever they become.
        super().__init__(*args, **kwargs)
        self.tracker = tracker

    def routing_request(
        self,
        parsed: ParsedRequest,
        headers: Mapping[str, str],
        request_id: str,
        prepared: Prepared | None = None,
    ) -> RoutingRequest:
        routing = super().routing_request(parsed, headers, request_id, prepared)
        if not parsed.previous_response_id:  # tokens of a follow-up's input are no prefix
            self.tracker.attach(routing.serial, parsed)
        return routing

    def uncached_tokens(self, routing: RoutingRequest, endpoint_id: str) -> int:
        share = self.tracker.held_share(routing.serial, endpoint_id)
        if share is None:
            return super().uncached_tokens(routing, endpoint_id)
        return routing.uncached_at(share)

    def prefilled(self, routing: RoutingRequest, endpoint_id: str) -> None:
        self.tracker.prefilled(routing.serial, endpoint_id)


def precise_enabled(config: GatewayConfig, plugins: Iterable[PluginConfig]) -> bool:
    """On when configured so, or (by default) when a scorer reads the precise index."""
    enabled = config.precise_prefix.enabled
    if enabled is not None:
        return enabled
    return any(
        p.type == SCORER_TYPE
        or (
            p.type == "ttft-cost-scorer"
            and p.parameters.get("prefixSource", p.parameters.get("prefix_source")) == "precise"
        )
        for p in plugins
    )
