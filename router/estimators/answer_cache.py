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

from collections import OrderedDict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric


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
        self._decay = decay
        # Answers shorter than this (two engine blocks) say little: the replica's count is
        # floored to whole blocks, the gateway's estimate is not.
        self._min_tokens = min_tokens
        self._max_models = max_models
        self._shares: OrderedDict[str, float] = OrderedDict()
        if registry is not None:
            registry.register(self)

    def share(self, model: str) -> float:
        return self._shares.get(model, self._prior)

    def observe(self, model: str, credited_tokens: float, found_tokens: float) -> None:
        """One answered request: ``credited_tokens`` of the previous answer were counted as
        cached on the endpoint it went to, and the replica's count exceeded what the index
        matched by ``found_tokens``."""
        if credited_tokens < self._min_tokens:
            return
        ratio = min(1.0, max(0.0, found_tokens / credited_tokens))
        d = self._decay
        self._shares[model] = d * self.share(model) + (1 - d) * ratio
        self._shares.move_to_end(model)
        while len(self._shares) > self._max_models:
            self._shares.popitem(last=False)

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "prefixgate_answer_cached_share",
            "Learned share of the previous turn's answer found cached where that turn was "
            "served, per model (1 until answers report cached tokens).",
            labels=["model"],
        )
        for model, share in list(self._shares.items()):
            gauge.add_metric([model], share)
        yield gauge
