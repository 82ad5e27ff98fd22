"""What the endpoint picker reads of an answer Envoy streams through it: the time to its first
token, and its usage (router/api/usage_tap.py), as the HTTP gateway's relay does.

Headers alone time nothing: a streaming vLLM sends them before the request is even scheduled.
A stream's first body chunk (with STREAMED or FULL_DUPLEX_STREAMED response bodies) is its
first token, except in a Responses stream, whose opening events come first
(:func:`router.protocol.responses_api.answer_begun`). Reading never cuts an answer: an error
in it is logged and the reading stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from router.api.streaming import tell_first_byte
from router.api.usage_tap import UsageTap, answer_taps
from router.app import Gateway
from router.core.framework import RoutingRequest
from router.core.lease import Lease
from router.protocol.responses_api import OPENING, TOKEN, answer_begun

log = logging.getLogger("prefixgate.extproc")

_MODE = processing_mode_pb2.ProcessingMode
_STREAMED_BODIES = (_MODE.STREAMED, _MODE.FULL_DUPLEX_STREAMED)


class AnswerWatch:
    """One answer's reading, from its headers to its end (each step at most once)."""

    __slots__ = ("_api", "_first_token", "_lease", "_observe", "_usage")

    def __init__(self, api: str, lease: Lease | None) -> None:
        self._api, self._lease = api, lease
        self._first_token = False
        self._observe: Callable[[bytes], None] | None = None
        self._usage: UsageTap | None = None

    def headers(
        self, gw: Gateway, routing: RoutingRequest | None, status: str, end_of_stream: bool,
        mode: int | None, destinations: list[str],
    ) -> None:
        """``mode``: the response body mode Envoy announced (None: not announced, so the
        body may never come: the first byte is told now, as headers alone)."""
        body_follows = (
            routing is not None and status == "200" and not end_of_stream and mode != _MODE.NONE
        )
        self._first_token = body_follows and routing is not None and routing.stream and (
            mode in _STREAMED_BODIES
        )
        if self._lease is not None and not self._first_token:
            self._lease.first_byte(tokens=False, answered=status.startswith(("1", "2", "3")))
        if body_follows and routing is not None:
            # With fallbacks another endpoint may have served it: where it is stored is probed.
            stores = gw.router.responses if self._api == "responses" else None
            self._observe, self._usage = answer_taps(
                200, destinations[0], routing, gw.prediction, gw.sizer.observe,
                stores if len(destinations) == 1 else None,
            )

    def body(self, chunk: bytes) -> None:
        if self._first_token and chunk:
            begun = answer_begun(chunk) if self._api == "responses" else TOKEN
            if begun != OPENING:
                self._first_token = False
                if self._lease is not None:
                    tell_first_byte(self._lease, begun)
        if self._observe is not None:
            try:
                self._observe(chunk)
            except Exception:
                log.exception("ext_proc: reading an answer's usage failed")
                self._observe = self._usage = None

    def finish(self) -> None:
        """The answer is whole: hand its usage over."""
        usage, self._observe, self._usage = self._usage, None, None
        if usage is not None:
            try:
                usage.finish()
            except Exception:
                log.exception("ext_proc: reading an answer's usage failed")
