"""How much of the previous turn's answer the replica that generated it turns out to hold.

vLLM caches the blocks of the tokens it generates, and a chat template that renders an answer
back as it was generated makes the next turn's prompt hit them, so the approximate index counts
the answer as cached where its turn was served (:meth:`RoutingRequest.cached_bytes
<router.core.framework.RoutingRequest.cached_bytes>`). A template that renders the history otherwise
(reasoning models whose templates drop the thinking from earlier turns: Qwen3, DeepSeek-R1)
breaks the prefix at the answer's start, and none of it hits. Which one a model does is learned
from the answers' ``usage``: the share of each credited answer that the replica reported as
cached, exponentially averaged per model, starting from 1. Without ``cached_tokens`` in the
usage (vLLM's ``--enable-prompt-tokens-details``) nothing is learned and the prior stands.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from router.estimators.model_average import ModelAverage


class AnswerCache:
    """The learned share of a previous answer found cached, per model."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        prior: float = 1.0,
        decay: float = 0.95,
        min_tokens: float = 32.0,
        max_models: int = 256,
    ) -> None:
        self._prior = prior
        # Weight of the past per answer: a half-life of ~14 answers.
        self._shares = ModelAverage(decay, max_models, prior)
        # Answers shorter than this (two engine blocks) say little: the replica's count is
        # floored to whole blocks, the gateway's estimate is not.
        self._min_tokens = min_tokens
        if registry is not None:
            registry.register(self)

    def share(self, model: str) -> float:
        share = self._shares.get(model)
        return self._prior if share is None else share

    def observe(self, model: str, credited_tokens: float, found_tokens: float) -> None:
        """One answered request: ``credited_tokens`` of the previous answer were counted as
        cached on the endpoint it went to, and the replica's count exceeded what the index
        matched by ``found_tokens``."""
        if credited_tokens < self._min_tokens:
            return
        self._shares.observe(model, min(1.0, max(0.0, found_tokens / credited_tokens)))

    def collect(self) -> Iterator[Metric]:
        yield self._shares.gauge(
            "prefixgate_answer_cached_share",
            "Learned share of the previous turn's answer found cached where that turn was "
            "served, per model (1 until answers report cached tokens).",
        )
