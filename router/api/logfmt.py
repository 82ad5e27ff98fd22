"""logfmt: the ``key=value`` text the text log format appends to a line (router/api/logs.py).

A value is quoted (as a JSON string) only when it must be: empty, unprintable, or holding a
space, a quote, an equals sign or a backslash. The access line is built here field by field
rather than through the mapping, since the writer thread writes one per request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from router.protocol.exchange import Exchange

# Strings remembered with their logfmt text (see Words); past this many, forgotten.
WORDS_SIZE = 1024

# A logfmt value with one of these (or empty, or unprintable) is quoted.
_QUOTED = re.compile(r'[ "=\\]')
_NUMBERS = frozenset({int, float, bool})


def logfmt_value(value: object) -> str:
    if value is None:
        return "-"
    text = str(value)
    if type(value) in _NUMBERS:
        return text  # never quoted: skip the checks
    if not text or _QUOTED.search(text) or not text.isprintable():
        return orjson.dumps(text).decode()
    return text


def logfmt(fields: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields.items())


class Words:
    """The logfmt text of strings that come back line after line (an api, a model, a tenant, an
    endpoint, an outcome): checked for quoting once rather than once a line. Bounded: when
    ``size`` are known it starts over."""

    __slots__ = ("_known", "_size")

    def __init__(self, size: int = WORDS_SIZE) -> None:
        self._known: dict[str | None, str] = {None: "-"}
        self._size = size

    def __call__(self, value: str | None) -> str:
        text = self._known.get(value)
        if text is None:
            if len(self._known) >= self._size:
                self._known = {None: "-"}
            text = self._known[value] = logfmt_value(value)
        return text


def access_logfmt(ex: Exchange, finished: float, word: Words) -> str:
    """``logfmt(ex.fields(finished))`` without the mapping, with each value's type known; the
    same fields in the same order (a test holds the two equal)."""
    stream, ttfb, match = ex.stream, ex.ttfb, ex.prefix_match
    return (
        f"request_id={logfmt_value(ex.request_id)} api={word(ex.api)} model={word(ex.model)}"
        f" stream={'-' if stream is None else stream} tenant={word(ex.tenant)}"
        f" endpoint={word(ex.endpoint)} status={ex.status} outcome={word(ex.outcome)}"
        f" attempts={ex.attempts} ttfb_ms={'-' if ttfb is None else round(ttfb * 1000, 2)}"
        f" duration_ms={round((finished - ex.started) * 1000, 2)}"
        f" prefix_match={'-' if match is None else round(match, 3)}"
    )
