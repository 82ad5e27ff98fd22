"""Bytes of rendered prompt per token, learned per model from the replicas' own token counts.

The approximate prefix index cuts prompts into blocks of bytes, but a replica's KV cache is
counted in tokens, and how many bytes a token covers depends on the model's tokenizer and on the
text (about 4 for English prose, 2-3 for code or CJK, 10 for some traces). Every answer's
``usage.prompt_tokens`` against the byte length of the prompt the gateway rendered gives one
sample of that ratio; see docs/prefix-index.md for how the index is sized from it.

The estimate is a ratio of exponentially decayed sums (bytes over tokens), so long prompts, which
dominate a KV cache, weigh in proportion to their size, and old samples fade with a half-life
counted in samples (no clock). Samples whose own ratio is absurd (an image counted as hundreds
of tokens, a truncated prompt) are dropped; the estimate is clamped to ``bounds`` and stays at
the prior until ``min_samples`` have been taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from router.core.hashing import BYTES_PER_TOKEN


@dataclass(slots=True)
class _Sums:
    bytes: float = 0.0
    tokens: float = 0.0
    samples: int = 0


class TokenDensity:
    """Per model, the learned bytes per token (see the module doc)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        prior: float = BYTES_PER_TOKEN,
        min_samples: int = 8,
        half_life: int = 256,
        bounds: tuple[float, float] = (1.0, 16.0),
    ) -> None:
        low, high = bounds
        if not 0 < low <= prior <= high:
            raise ValueError("need 0 < bounds[0] <= prior <= bounds[1]")
        if min_samples < 1 or half_life < 1:
            raise ValueError("min_samples and half_life must be >= 1")
        self.prior = prior
        self._min_samples = min_samples
        self._decay = 0.5 ** (1.0 / half_life)
        self._low, self._high = low, high
        self._sums: dict[str, _Sums] = {}
        self._gauge = Gauge(
            "prefixgate_bytes_per_token",
            "Rendered prompt bytes per token, learned per model from the answers' "
            "usage.prompt_tokens (the prior until enough answers).",
            ["model"],
            registry=registry,
        )

    def observe(self, model: str, prompt_bytes: int, tokens: int) -> bool:
        """Take one answer's sample; False if it was dropped as implausible."""
        if prompt_bytes <= 0 or tokens <= 0:
            return False
        # A single sample may sit well outside the bounds (a short prompt is mostly template),
        # but not absurdly so.
        if not self._low / 2 <= prompt_bytes / tokens <= self._high * 2:
            return False
        sums = self._sums.get(model)
        if sums is None:
            sums = self._sums[model] = _Sums()
            # Read when scraped, not set per answer.
            self._gauge.labels(model).set_function(lambda: self.ratio(model))
        sums.bytes = sums.bytes * self._decay + prompt_bytes
        sums.tokens = sums.tokens * self._decay + tokens
        sums.samples += 1
        return True

    def ratio(self, model: str) -> float:
        """Bytes per token for ``model``: the prior until enough samples, then the estimate."""
        sums = self._sums.get(model)
        if sums is None or sums.samples < self._min_samples or sums.tokens <= 0:
            return self.prior
        return min(self._high, max(self._low, sums.bytes / sums.tokens))

    def samples(self, model: str) -> int:
        sums = self._sums.get(model)
        return sums.samples if sums is not None else 0
