"""How long a model's answers run, in tokens: the KV cache an answer adds while it decodes.

A request holds its prompt's blocks in the engine's cache, and each token it generates adds to
them until it ends. Where the prompt is mostly a context that other requests of its session
share (sub-agents forked from one agent's history), the answer can be most of what the request
adds: pricing the wait for KV room without it lets a fan-out pile onto one replica until the
engine preempts (``RoutingRequest.kv_claim``). The mean answer length is learned per model from
the answers' ``usage`` (``completion_tokens``, or ``output_tokens``), exponentially averaged;
until a model's first answer is read it is 0, and claims count the prompt only.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from router.estimators.model_average import ModelAverage


class AnswerLengths:
    """The learned mean answer length, in tokens, per model."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        decay: float = 0.95,
        max_models: int = 256,
    ) -> None:
        # Weight of the past per answer: a half-life of ~14 answers.
        self._means = ModelAverage(decay, max_models)
        if registry is not None:
            registry.register(self)

    def tokens(self, model: str) -> int:
        """The tokens a new answer of ``model`` is expected to generate (0: none read yet)."""
        return round(self._means.get(model) or 0.0)

    def observe(self, model: str, completion_tokens: int) -> None:
        """One answer of ``model`` generated ``completion_tokens``."""
        self._means.observe(model, completion_tokens)

    def collect(self) -> Iterator[Metric]:
        yield self._means.gauge(
            "prefixgate_answer_tokens",
            "Learned mean length of an answer in tokens, per model (the KV cache an answer "
            "adds while it decodes; absent until the model's answers report usage).",
        )
