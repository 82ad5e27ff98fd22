"""Token counts in an answer's ``usage``, whichever of the three APIs the answer speaks.

The answer's own count is ``completion_tokens`` (OpenAI chat and completions) or
``output_tokens`` (Responses, Messages). The prompt's:

- OpenAI chat and completions: ``prompt_tokens``, of which
  ``prompt_tokens_details.cached_tokens`` were read from the prefix cache.
- OpenAI Responses: ``input_tokens`` (every prompt token), of which
  ``input_tokens_details.cached_tokens`` were cached.
- Anthropic Messages: ``input_tokens`` counts only the prompt tokens *not* read from or written
  to the cache; ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` are the rest.
  Where an engine reports no cache fields, ``input_tokens`` is the whole prompt.

Where they sit in an answer (a JSON body, or an SSE stream whose events nest ``usage`` in a
``message`` or ``response``) is router/api/usage_tap.py's concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Anthropic's prompt tokens beside input_tokens.
_ANTHROPIC_CACHE = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def prompt_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """The prompt's whole token count, cached or not, if ``usage`` gives a positive one."""
    if not isinstance(usage, Mapping):
        return None
    total = _count(usage.get("prompt_tokens"))
    if total is None:
        total = _count(usage.get("input_tokens"))
        if total is not None:
            total += sum(_count(usage.get(key)) or 0 for key in _ANTHROPIC_CACHE)
    return total if total else None


def cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """How many of the prompt's tokens the engine read from its prefix cache, if ``usage``
    says (None where it does not: an engine without prefix-cache stats)."""
    if not isinstance(usage, Mapping):
        return None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, Mapping):
            cached = _count(details.get("cached_tokens"))
            if cached is not None:
                return cached
    return _count(usage.get("cache_read_input_tokens"))


def answer_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """How many tokens the answer generated (``completion_tokens``, or ``output_tokens`` in
    the Responses and Messages APIs), if ``usage`` says."""
    if not isinstance(usage, Mapping):
        return None
    count = _count(usage.get("completion_tokens"))
    return count if count is not None else _count(usage.get("output_tokens"))


# The fields that count a prompt, in any of the three APIs.
PROMPT_FIELDS = (
    "prompt_tokens", "prompt_tokens_details", "input_tokens", "input_tokens_details",
    *_ANTHROPIC_CACHE,
)


def with_prompt_counts(
    last: Mapping[str, Any] | None, first: Mapping[str, Any]
) -> dict[str, Any]:
    """``last`` (a stream's final usage) with the prompt's counts taken from ``first`` (its
    first event's): a Messages stream counts its prompt in ``message_start`` only, and an
    engine may zero-fill those fields in the final ``message_delta``."""
    merged = dict(last or {})
    merged.update((k, first[k]) for k in PROMPT_FIELDS if k in first)
    return merged
