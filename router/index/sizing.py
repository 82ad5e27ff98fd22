"""Each endpoint's approximate-index capacity, in blocks of bytes, from its KV size in tokens.

A replica reports how many tokens its KV cache holds (``vllm:cache_config_info``: blocks x
block size). The index should forget a prefix about when the replica does, so its capacity is
those tokens at the endpoint's model's learned bytes per token
(:mod:`router.estimators.token_density`),
divided by the index's block size in bytes. The capacity is re-derived only when the ratio has
moved materially since it was last applied, so a resize (which may evict) is rare. An explicit
``prefixIndex.capacityBlocks`` overrides all of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from router.core.framework import RoutingRequest
from router.core.pool import EndpointPool
from router.core.usage import prompt_tokens
from router.estimators.token_density import TokenDensity
from router.index.prefix_index import PrefixIndex

# Re-derive an endpoint's capacity when its ratio has moved by more than this share.
DEFAULT_RESIZE_THRESHOLD = 0.1


class IndexSizer:
    """Learns bytes per token from answers and sizes the index per endpoint from it."""

    def __init__(
        self,
        index: PrefixIndex,
        density: TokenDensity,
        block_bytes: int,
        *,
        fixed_blocks: int | None = None,
        models: Mapping[str, str] | None = None,
        pool: EndpointPool | None = None,
        registry: CollectorRegistry | None = None,
        threshold: float = DEFAULT_RESIZE_THRESHOLD,
    ) -> None:
        self._index = index
        self.density = density
        self._block_bytes = block_bytes
        self._fixed = fixed_blocks
        self._threshold = threshold
        # The endpoints in the pool (None: any endpoint is): an answer or a token count that
        # finishes after its endpoint was forgotten (its pod gone) must not bring its
        # bookkeeping back, for good.
        self._pool = pool
        # The model each endpoint serves: configured, else the last one answered there, else
        # (an endpoint that has answered nothing yet) the last model answered anywhere.
        self._configured: dict[str, str] = dict(models or {})
        self._models: dict[str, str] = dict(self._configured)
        # Per endpoint, the one base model its /v1/models names (its LoRA adapters run on it).
        self._bases: dict[str, str] = {}
        self._last_model: str | None = None
        self._kv_tokens: dict[str, int] = {}
        self._applied: dict[str, float] = {}  # per endpoint, the ratio its capacity is at
        self._checked: dict[str, float] = {}  # per model, its ratio at the last resize check
        self._capacity = Gauge(
            "prefixgate_prefix_index_capacity_blocks",
            "Blocks the approximate prefix index keeps per endpoint: its KV tokens at the "
            "learned bytes per token (or prefixIndex.capacityBlocks).",
            ["endpoint"],
            registry=registry,
        )

    def kv_capacity(self, endpoint_id: str, kv_tokens: int) -> None:
        """The endpoint reported (or changed) its KV size in tokens."""
        if kv_tokens <= 0 or not self._present(endpoint_id):
            return
        self._kv_tokens[endpoint_id] = kv_tokens
        self._resize(endpoint_id, self._ratio(endpoint_id))

    def observe(
        self, endpoint_id: str, routing: RoutingRequest, usage: Mapping[str, Any] | None
    ) -> None:
        """One answer's usage (after the response; never raises on odd input)."""
        tokens = prompt_tokens(usage)
        if tokens is None or not routing.prompt_bytes or not routing.model:
            return
        if routing.previous_response_id:
            return  # the replica counted stored turns the gateway never saw
        self.count(endpoint_id, routing.model, routing.prompt_bytes, tokens)

    def count(self, endpoint_id: str, model: str, prompt_bytes: int, tokens: int) -> None:
        """A prompt of ``prompt_bytes`` rendered bytes was ``tokens`` tokens on the endpoint
        (its answer's usage, or router/index/token_counts.py)."""
        self._last_model = model
        if self._present(endpoint_id):  # else only the model's ratio learns from it
            self._models[endpoint_id] = self._own_model(endpoint_id) or model
        if not self.density.observe(model, prompt_bytes, tokens):
            return
        ratio = self.density.ratio(model)
        if self._moved(ratio, self._checked.get(model, self.density.prior)):
            self._checked[model] = ratio
            self._resize_moved()
        elif self._moved(self._ratio(endpoint_id), self._applied.get(endpoint_id)):
            self._resize(endpoint_id, self._ratio(endpoint_id))  # it just changed model

    def base_model(self, endpoint_id: str, model: str | None) -> None:
        """The one base model the endpoint serves, adapters aside (None: not one), from its
        /v1/models: it sizes the endpoint whatever model answers there, as a configured one
        does, since the adapters' KV is the base model's."""
        if not self._present(endpoint_id):
            return
        if model is None:
            self._bases.pop(endpoint_id, None)
        else:
            self._bases[endpoint_id] = model
        if self._moved(self._ratio(endpoint_id), self._applied.get(endpoint_id)):
            self._resize(endpoint_id, self._ratio(endpoint_id))

    def capacity_blocks(self, endpoint_id: str) -> int | None:
        """The capacity last applied to ``endpoint_id`` (None: never sized)."""
        if self._fixed is not None:
            return self._fixed
        ratio = self._applied.get(endpoint_id)
        kv = self._kv_tokens.get(endpoint_id)
        return None if ratio is None or kv is None else self._blocks(kv, ratio)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """Drop an endpoint that left the pool (async, like the other stores' forget)."""
        for table in (self._models, self._bases, self._kv_tokens, self._applied):
            table.pop(endpoint_id, None)
        with contextlib.suppress(KeyError):  # never sized
            self._capacity.remove(endpoint_id)

    def _present(self, endpoint_id: str) -> bool:
        return self._pool is None or self._pool.get(endpoint_id) is not None

    def _moved(self, ratio: float, applied: float | None) -> bool:
        return applied is not None and abs(ratio / applied - 1.0) > self._threshold

    def _resize_moved(self) -> None:
        """Every endpoint whose ratio moved materially (rare: the loop is over the pool)."""
        for endpoint_id in list(self._kv_tokens):
            ratio = self._ratio(endpoint_id)
            if self._moved(ratio, self._applied.get(endpoint_id)):
                self._resize(endpoint_id, ratio)

    def _own_model(self, endpoint_id: str) -> str | None:
        """The model that sizes the endpoint whatever answers there, if one does: the one it
        is configured with (a static endpoint's, given at construction, or a discovered
        one's, ``discovery.models``), else the base model its /v1/models names."""
        model = self._configured.get(endpoint_id)
        state = self._pool.get(endpoint_id) if model is None and self._pool is not None else None
        if state is not None and len(state.endpoint.models) == 1:
            (model,) = state.endpoint.models
        return model or self._bases.get(endpoint_id)

    def _ratio(self, endpoint_id: str) -> float:
        model = self._own_model(endpoint_id) or self._models.get(
            endpoint_id, self._last_model
        )
        return self.density.prior if model is None else self.density.ratio(model)

    def _blocks(self, kv_tokens: int, ratio: float) -> int:
        return max(1, int(kv_tokens * ratio // self._block_bytes))

    def _resize(self, endpoint_id: str, ratio: float) -> None:
        kv = self._kv_tokens.get(endpoint_id)
        if kv is None:
            return
        self._applied[endpoint_id] = ratio
        if self._fixed is not None:
            return
        blocks = self._blocks(kv, ratio)
        self._index.set_capacity(endpoint_id, blocks)
        self._capacity.labels(endpoint_id).set(blocks)
