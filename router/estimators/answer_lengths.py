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

from collections import OrderedDict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric


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
        self._decay = decay
        self._max_models = max_models
        self._means: OrderedDict[str, float] = OrderedDict()
        if registry is not None:
            registry.register(self)

    def tokens(self, model: str) -> int:
        """The tokens a new answer of ``model`` is expected to generate (0: none read yet)."""
        return round(self._means.get(model, 0.0))

    def observe(self, model: str, completion_tokens: int) -> None:
        """One answer of ``model`` generated ``completion_tokens``."""
        mean = self._means.get(model)
        d = self._decay
        self._means[model] = completion_tokens if mean is None else d * mean + (1 - d) * (
            completion_tokens
        )
        self._means.move_to_end(model)
        while len(self._means) > self._max_models:
            self._means.popitem(last=False)

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "prefixgate_answer_tokens",
            "Learned mean length of an answer in tokens, per model (the KV cache an answer "
            "adds while it decodes; absent until the model's answers report usage).",
            labels=["model"],
        )
        for model, mean in list(self._means.items()):
            gauge.add_metric([model], mean)
        yield gauge
