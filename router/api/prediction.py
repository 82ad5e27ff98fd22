"""How right is each prefix index? Predicted vs actual cached tokens, per request.

When a response's usage carries ``prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``; the simulator always), the prediction each index made for the
chosen endpoint at pick time is compared with it:

- ``approximate``: the approximate index's matched share of the rendered prompt (run on over
  the previous turn's answer where the endpoint served that turn), applied to the real prompt
  length and rounded down to whole engine blocks;
- ``precise``: the leading blocks the endpoint holds at the pick, for endpoints whose stream
  is trusted: announced by its events, or about to be computed there by a request the gateway
  sent earlier (speculative entries). vLLM v1 makes a block findable as soon as the step that
  computes it is scheduled, and admits requests in order, so a request sent after another with
  the same prefix hits what that one is computing, even within the same step;
- ``precise_confirmed``: events and finished prefills only (requests whose first byte came
  back; their events may still be on the way): what the replica certainly holds at the pick,
  a lower bound. The gap between the two is the share of hits that depend on requests in
  flight (bursts of sub-agents on one prefix).

Both are capped like vLLM's lookup (at most ``prompt_tokens - 1`` tokens, whole blocks). The
signed error (predicted - actual; positive = over-prediction) goes to histograms in tokens and
in blocks, and a gauge gives the share of the last ``window`` predictions within one block.

With a ``sampler`` (router/core/sampling.py), answers beyond its rate are not read at all (the
skipped counter says how many, reason ``sampled_out``): neither compared nor handed to the other
usage reader (the index sizer's bytes per token). Every answer read also teaches its model's
answer length (``lengths``, router/estimators/answer_lengths.py), whatever else it reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.core.framework import RoutingRequest
from router.core.histogram import LoopHistogram
from router.core.sampling import RateSampler
from router.core.usage import answer_tokens, cached_tokens, prompt_tokens
from router.estimators.answer_cache import AnswerCache
from router.estimators.answer_lengths import AnswerLengths


class PreciseFacts(Protocol):
    """What precise routing predicted for one request, per endpoint (leading blocks)."""

    @property
    def expected(self) -> Mapping[str, int]: ...

    @property
    def confirmed(self) -> Mapping[str, int]: ...

    @property
    def keys(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def trusted(self) -> AbstractSet[str]: ...

    @property
    def picked_at(self) -> float | None: ...


class PreciseStates(Protocol):
    """Precise routing's per-request facts (router.precise.routing.PreciseTracker): typed
    here so the always-on proxy does not import the precise stack (and zmq) for a hint."""

    def finish(self, serial: int) -> PreciseFacts | None: ...


# How many answers a second the gateway reads the usage of (router/core/sampling.py): every
# answer at agents' rates; at a synthetic thousands a second, a share.
ANSWERS_READ_PER_S = 200.0
ANSWERS_READ_BURST = 200.0

MODES = ("approximate", "precise", "precise_confirmed")
_TOKEN_BUCKETS = tuple(
    [-float(4**i) for i in range(8, 0, -1)] + [-1.0, 0.0, 1.0] + [float(4**i) for i in range(1, 9)]
)
_BLOCK_BUCKETS = (-256.0, -64.0, -16.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 16.0, 64.0, 256.0)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int


def parse_usage(usage: Mapping[str, Any] | None) -> Usage | None:
    """``usage`` of an answer (any of the three APIs), if it reports cached tokens."""
    prompt = prompt_tokens(usage)
    cached = cached_tokens(usage)
    if prompt is None or cached is None:
        return None
    return Usage(prompt, cached)


@dataclass(slots=True)
class ModeSummary:
    count: int = 0
    within_one_block: int = 0
    abs_error_tokens: int = 0
    over: int = 0
    under: int = 0

    def as_dict(self) -> dict[str, float]:
        n = max(self.count, 1)
        return {
            "count": self.count,
            "within_one_block_ratio": self.within_one_block / n,
            "mean_abs_error_tokens": self.abs_error_tokens / n,
            "over": self.over,
            "under": self.under,
        }


class PredictionTracker:
    """Exports each index's prediction error; see the module doc."""

    def __init__(
        self,
        registry: CollectorRegistry,
        block_size: int = 16,
        precise: PreciseStates | None = None,
        expect_events: Callable[[str, float], None] | None = None,
        window: int = 1000,
        answers: AnswerCache | None = None,
        sampler: RateSampler | None = None,
        lengths: AnswerLengths | None = None,
    ) -> None:
        self.block_size = block_size
        self._sampler = sampler
        self._precise = precise
        self._expect_events = expect_events
        self._answers = answers
        self._lengths = lengths
        r = registry
        self.error_tokens = LoopHistogram(
            "prefixgate_prefix_prediction_error_tokens",
            "Predicted minus actual cached prompt tokens on the chosen endpoint, by index mode.",
            ["mode"], buckets=_TOKEN_BUCKETS, registry=r,
        )
        self.error_blocks = LoopHistogram(
            "prefixgate_prefix_prediction_error_blocks",
            "Predicted minus actual cached prompt tokens, in engine blocks, by index mode.",
            ["mode"], buckets=_BLOCK_BUCKETS, registry=r,
        )
        self.within_ratio = Gauge(
            "prefixgate_prefix_prediction_within_one_block_ratio",
            "Share of recent predictions within one block of the actual cached tokens.",
            ["mode"], registry=r,
        )
        self.skipped = Counter(
            "prefixgate_prefix_prediction_skipped",
            "Responses not compared, by reason (no_usage, untrusted, untokenized, sampled_out, "
            "remote_prefill).",
            ["reason"], registry=r,
        )
        self.skips: dict[str, int] = {}  # the skipped counter's values, by reason
        self._skipped: dict[str, Counter] = {}  # its children
        self._recent = {m: deque[bool](maxlen=max(1, window)) for m in MODES}
        self._within = dict.fromkeys(MODES, 0)
        self.summary = {m: ModeSummary() for m in MODES}
        # Each mode's series, found once: ``labels`` per observation cost more than the rest.
        self._series = {
            m: (
                self.error_tokens.labels(m), self.error_blocks.labels(m),
                self.within_ratio.labels(m),
            )
            for m in MODES
        }

    def sampled(self, routing: RoutingRequest) -> bool:
        """Whether this answer's usage is to be read (``observe``); if not, what precise
        routing kept for the request is dropped now."""
        if self._sampler is None or self._sampler.take():
            return True
        if self._precise is not None:
            self._precise.finish(routing.serial)
        self._skip("sampled_out")
        return False

    def _cap(self, tokens: float, prompt_tokens: int) -> int:
        bs = self.block_size
        limit = max(prompt_tokens - 1, 0) // bs * bs
        return min(int(tokens) // bs * bs, limit)

    def observe(
        self, endpoint_id: str, routing: RoutingRequest, usage: Mapping[str, Any] | None
    ) -> None:
        """Compare both indexes' predictions for ``endpoint_id`` with the response's usage.

        Call once per answered request, with the ``usage`` object of the non-streaming body
        or of the final SSE chunk (``find_usage`` extracts it). Never raises on odd input.
        """
        state = self._precise.finish(routing.serial) if self._precise is not None else None
        lengths = self._lengths
        if lengths is not None and not routing.prefill_step:
            generated = answer_tokens(usage)
            if generated is not None:
                lengths.observe(routing.model, generated)
        if routing.remote_prefill:
            # vLLM counts the KV a decode endpoint pulled as cached: nothing any index said.
            self._skip("remote_prefill")
            return
        actual = parse_usage(usage)
        if actual is None:
            self._skip("no_usage")
            return
        if routing.block_hashes and routing.prompt_bytes:
            share = routing.cached_bytes(endpoint_id) / routing.prompt_bytes
            predicted = self._cap(share * actual.prompt_tokens, actual.prompt_tokens)
            self._record("approximate", predicted, actual)
            self._learn_answer(endpoint_id, routing, actual)
        elif routing.prompt_bytes and not routing.previous_response_id:
            # (A follow-up's input is the end of the replica's prompt: the index was not asked.)
            self._record("approximate", 0, actual)
        if self._precise is None:
            return
        if state is None or (not state.keys and not state.num_tokens):
            self._skip("untokenized")
            return
        if endpoint_id not in state.trusted:
            self._skip("untrusted")
            return
        for mode, held in (
            ("precise", state.expected.get(endpoint_id, 0)),
            ("precise_confirmed", state.confirmed.get(endpoint_id, 0)),
        ):
            self._record(mode, self._cap(held * self.block_size, actual.prompt_tokens), actual)
        # A replica that computed two or more new blocks must have announced at least one.
        uncached = actual.prompt_tokens - actual.cached_tokens
        expect = self._expect_events
        if expect is not None and state.picked_at is not None and uncached >= 2 * self.block_size:
            expect(endpoint_id, state.picked_at)

    def _learn_answer(self, endpoint_id: str, routing: RoutingRequest, actual: Usage) -> None:
        """How much of the previous answer, counted as cached, the replica really held."""
        answers = self._answers
        beyond = routing.answer_bytes_beyond(endpoint_id)
        if answers is None or not beyond:
            return
        tokens_per_byte = actual.prompt_tokens / routing.prompt_bytes
        matched = routing.matched_bytes(endpoint_id) * tokens_per_byte
        if actual.cached_tokens < matched - self.block_size:
            return  # the matched prefix itself was not all there (evicted): says nothing
        # The replica counts whole blocks: half a block of the answer's end is lost on average.
        credited = beyond * tokens_per_byte - self.block_size / 2
        answers.observe(routing.model, credited, actual.cached_tokens - matched)

    def _skip(self, reason: str) -> None:
        child = self._skipped.get(reason)
        if child is None:
            child = self._skipped[reason] = self.skipped.labels(reason)
        child.inc()
        self.skips[reason] = self.skips.get(reason, 0) + 1

    def _record(self, mode: str, predicted: int, actual: Usage) -> None:
        error = predicted - actual.cached_tokens
        blocks = error / self.block_size
        within = abs(error) <= self.block_size
        tokens, blocks_seen, within_ratio = self._series[mode]
        tokens.observe(error)
        blocks_seen.observe(blocks)
        recent = self._recent[mode]
        # A running count: summing the window on every request cost more than the rest here.
        if len(recent) == recent.maxlen:
            self._within[mode] -= recent[0]
        recent.append(within)
        self._within[mode] += within
        within_ratio.set(self._within[mode] / len(recent))
        s = self.summary[mode]
        s.count += 1
        s.within_one_block += within
        s.abs_error_tokens += abs(error)
        s.over += error > self.block_size
        s.under += error < -self.block_size
