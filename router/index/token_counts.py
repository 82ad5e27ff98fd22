"""Token counts of prompts whose answers will report none, asked of the replica's ``/tokenize``.

A streamed chat or completion answer carries ``usage`` only when the client asked for
``stream_options.include_usage``. Traffic that never does would leave bytes per token at the
prior (router/estimators/token_density.py), and the index sized for text it is not
(docs/prefix-index.md). So while a model has fewer than ``samples`` of the ratio, the gateway
asks a replica serving it to count such a prompt (vLLM and the simulator serve
``POST /tokenize``, which applies the chat template as the completion would): after the pick,
off the request's path, one call at a time per model, on the monitor's client, at most
``ATTEMPTS_PER_SAMPLE`` calls per sample wanted (a count the ratio's bounds reject is no
sample). An endpoint that does not serve the route (404, 405, 501) is not asked again for
``UNABLE_RETRY_S``; any other failure is taken as passing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from router.core.endpoints import EndpointSnapshot
from router.index.sizing import IndexSizer
from router.upstream.client import UPSTREAM_ERRORS, UpstreamClient

log = logging.getLogger("prefixgate.token_counts")

DEFAULT_SAMPLES = 16
ATTEMPTS_PER_SAMPLE = 4
TIMEOUT_S = 2.0
UNABLE_RETRY_S = 600.0
MAX_ANSWER_BYTES = 64 << 20  # the ids of a long prompt, as vLLM lists them
NO_ROUTE = (404, 405, 501)
# Fields of a chat request that change its prompt's tokens, as /tokenize takes them.
_CHAT_FIELDS = (
    "tools", "chat_template", "chat_template_kwargs", "continue_final_message",
    "add_special_tokens",
)
Headers = Callable[[str], list[tuple[str, str]]]


def tokenize_body(api: str, model: str, payload: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` request that counts what the completion of ``payload`` would, or
    None where there is none (a batch of prompts, token ids, an API the route does not take)."""
    if api == "chat":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        body: dict[str, Any] = {"model": model, "messages": messages}
        body["add_generation_prompt"] = payload.get("add_generation_prompt", True)
        body.update((k, payload[k]) for k in _CHAT_FIELDS if payload.get(k) is not None)
        return body
    if api == "completions" and isinstance(payload.get("prompt"), str):
        body = {"model": model, "prompt": payload["prompt"]}
        if payload.get("add_special_tokens") is not None:
            body["add_special_tokens"] = payload["add_special_tokens"]
        return body
    return None


def reports_usage(api: str, stream: bool, payload: Mapping[str, Any]) -> bool:
    """Whether the answer will carry ``usage``: every non-streamed one, every Messages and
    Responses stream, and chat or completion streams whose client asked for it."""
    if not stream or api not in ("chat", "completions"):
        return True
    options = payload.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))


class TokenCounts:
    """Asks replicas to count prompts whose answers will not (see the module doc)."""

    def __init__(
        self,
        sizer: IndexSizer,
        client: UpstreamClient,
        headers: Headers | None = None,
        *,
        samples: int = DEFAULT_SAMPLES,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sizer = sizer
        self._client = client
        self._headers = headers
        self._samples = samples
        self._timeout = timeout_s
        self._clock = clock
        self._asking: set[str] = set()  # models with a call in flight
        self._attempts: dict[str, int] = {}  # per model, calls made
        self._unable: dict[str, float] = {}  # endpoint -> when it answered it has no route
        self._tasks: set[asyncio.Task[None]] = set()

    def wants(self, model: str) -> bool:
        """Whether a prompt of ``model`` should be counted now (cheap: read per request)."""
        return (
            model not in self._asking
            and self._sizer.density.samples(model) < self._samples
            and self._attempts.get(model, 0) < ATTEMPTS_PER_SAMPLE * self._samples
        )

    def consider(
        self, api: str, stream: bool, payload: Mapping[str, Any], model: str, prompt_bytes: int,
        endpoint: EndpointSnapshot, *, answer_seen: bool = True,
    ) -> None:
        """After a pick: count the request's prompt on the picked endpoint, in the background,
        if its answer will report no usage (or will not be seen: an ext_proc picker that
        Envoy sends no response body) and the model still wants samples."""
        if (
            not self.wants(model) or prompt_bytes <= 0 or self._is_unable(endpoint.id)
            or (answer_seen and reports_usage(api, stream, payload))
        ):
            return
        body = tokenize_body(api, model, payload)
        if body is None:
            return
        self._asking.add(model)
        self._attempts[model] = self._attempts.get(model, 0) + 1
        task = asyncio.get_running_loop().create_task(
            self._count(endpoint.id, endpoint.url, model, prompt_bytes, body),
            name="prefixgate-token-count",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _is_unable(self, endpoint_id: str) -> bool:
        since = self._unable.get(endpoint_id)
        if since is None:
            return False
        if self._clock() - since < UNABLE_RETRY_S:
            return True
        del self._unable[endpoint_id]  # a replaced pod may serve the route: ask again
        return False

    async def _count(
        self, endpoint_id: str, url: str, model: str, prompt_bytes: int, body: dict[str, Any]
    ) -> None:
        try:
            tokens = await self._ask(endpoint_id, url, body)
            if tokens is not None:
                self._sizer.count(endpoint_id, model, prompt_bytes, tokens)
        except Exception:  # a bug here must not go unseen, nor stop the counting
            log.exception("token count on %s failed", endpoint_id)
        finally:
            self._asking.discard(model)

    async def _ask(self, endpoint_id: str, url: str, body: dict[str, Any]) -> int | None:
        headers = [("content-type", "application/json")]
        if self._headers is not None:
            headers += self._headers(endpoint_id)
        try:
            reply = await self._client.fetch(
                "POST", url + "/tokenize", headers, orjson.dumps(body), seconds=self._timeout,
                limit=MAX_ANSWER_BYTES,
            )
        except UPSTREAM_ERRORS as exc:
            log.debug("token count on %s failed: %r", endpoint_id, exc)
            return None  # passing: a later prompt asks again
        if reply.status in NO_ROUTE:
            self._unable[endpoint_id] = self._clock()
            log.info(
                "%s serves no /tokenize (%d): not asked again for %.0f s",
                endpoint_id, reply.status, UNABLE_RETRY_S,
            )
            return None
        return _count_of(reply.body) if reply.status == 200 else None

    async def settle(self) -> None:
        """Wait for the counts asked so far (each bounded by its timeout)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.settle()


def _count_of(data: bytes) -> int | None:
    """The prompt's token count in a ``/tokenize`` answer (``count``, else the ids' number)."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    count = answer.get("count")
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        return count
    tokens = answer.get("tokens")
    return len(tokens) if isinstance(tokens, list) and tokens else None
