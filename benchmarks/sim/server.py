"""The OpenAI-compatible HTTP face of one simulated replica (a Starlette app).

``create_app(config)`` builds everything a replica needs (engine, tokenizer, metrics) with no
globals. Generation requests are answered by ``responses.GenerationResponse``.

Besides completions and chat completions, a replica serves the agent APIs vLLM serves: the
Anthropic Messages API (``anthropic_api``) and the OpenAI Responses API (``responses_api``),
through the same engine, tokenizer and chat template.

Fault knobs (``POST /sim/faults``) apply to the generation routes only (completions, chat,
messages, responses), so health checks and metrics keep answering while inference misbehaves.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import anthropic_api, responses_api
from . import protocol as p
from .config import SimConfig
from .engine import Engine
from .kv_events import KVEventPublisher
from .metrics import CONTENT_TYPE, SimMetrics
from .request import SimRequest
from .responses import GenerationResponse, HangResponse, error_response, json_response
from .responses_output import ResponseStore

SIM_VERSION = "0.11.0"


@dataclass
class Faults:
    """Injected misbehaviour for reliability tests."""

    fail_rate: float = 0.0
    status: int = 500
    delay_ms: float = 0.0
    hang: bool = False


class SimServer:
    """Routes of one replica; holds its engine, metrics and fault settings."""

    def __init__(
        self,
        config: SimConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_id: str = "",
        kv_events_port: int | None = None,
        kv_events_replay_port: int | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.metrics = SimMetrics(config.model_names[0])
        self.kv_publisher: KVEventPublisher | None = None
        if kv_events_port is not None:
            endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            self.kv_publisher = KVEventPublisher(
                host,
                kv_events_port,
                topic=f"kv@{endpoint}@{config.model_names[0]}",
                encoding="map" if config.kv_events_encoding == "map" else "array",
                replay_port=kv_events_replay_port,
            )
        self.engine = Engine(
            config,
            engine_id or f"sim-{uuid.uuid4().hex[:12]}",
            self.metrics,
            kv_events=self.kv_publisher,
        )
        self.metrics.attach(self.engine)
        self.faults = Faults()
        self._fault_rng = random.Random(config.seed)
        self.responses = ResponseStore()

    def transfer_params(self, req: SimRequest) -> dict[str, Any]:
        """What a prefill server tells the proxy to forward to the decode server (Nixl)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": req.transfer_block_ids,
            "remote_engine_id": self.engine.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    def routes(self) -> list[Route]:
        get, post = ["GET"], ["POST"]
        return [
            Route("/v1/completions", self.completions, methods=post),
            Route("/v1/chat/completions", self.chat_completions, methods=post),
            Route("/v1/messages", self.messages, methods=post),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=post),
            Route("/v1/responses", self.create_response, methods=post),
            Route("/v1/responses/{response_id}", self.get_response, methods=get),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/completions/render", self.render_completion, methods=post),
            Route("/v1/chat/completions/render", self.render_chat, methods=post),
            Route("/v1/models", self.models, methods=get),
            Route("/health", self.health, methods=get),
            Route("/version", self.version, methods=get),
            Route("/tokenize", self.tokenize, methods=post),
            Route("/detokenize", self.detokenize, methods=post),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=post),
            Route("/metrics", self.metrics_endpoint, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/server_info", self.server_info, methods=get),
            Route("/v1/loads", self.loads, methods=get),
            Route("/sim/state", self.state, methods=get),
            Route("/sim/faults", self.set_faults, methods=post),
            Route("/sim/faults", self.clear_faults, methods=["DELETE"]),
        ]

    # -- generation ---------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def messages(self, request: Request) -> Response:
        return await anthropic_api.handle(self, request)

    async def count_tokens(self, request: Request) -> Response:
        return await anthropic_api.count_tokens(self, request)

    async def create_response(self, request: Request) -> Response:
        return await responses_api.create(self, request)

    async def get_response(self, request: Request) -> Response:
        return responses_api.retrieve(self, request.path_params["response_id"])

    async def delete_response(self, request: Request) -> Response:
        return responses_api.delete(self, request.path_params["response_id"])

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        fault = await self.injected_fault()
        if fault is not None:
            return fault if isinstance(fault, Response) else error_response(fault)
        try:
            body = p.parse_json(await request.body())
            params = p.parse_generation(body, self.config, self.engine.tokenizer, chat)
        except p.ApiError as err:
            return error_response(err)
        too_big = self.capacity_error(params)
        if too_big is not None:
            return error_response(too_big)
        return GenerationResponse(
            self.engine, self.new_request(params), params, self.transfer_params
        )

    async def injected_fault(self) -> Response | p.ApiError | None:
        """The fault knobs applied to one generation request: after the delay, a response that
        never comes, an error to answer (in the API's own shape), or None to serve it."""
        faults = self.faults
        if faults.delay_ms > 0:
            await asyncio.sleep(faults.delay_ms / 1000.0)
        if faults.hang:
            return HangResponse()
        if faults.fail_rate > 0 and self._fault_rng.random() < faults.fail_rate:
            return p.ApiError("Injected failure.", status=faults.status)
        return None

    def capacity_error(self, params: p.GenerationParams) -> p.ApiError | None:
        total = len(params.prompt_ids) + params.max_tokens
        if self.engine.fits(total):
            return None
        return p.ApiError(
            f"The request needs {total} tokens of KV cache but the replica holds "
            f"{self.config.num_gpu_blocks * self.config.block_size}.",
            param="max_tokens",
        )

    def new_request(self, params: p.GenerationParams) -> SimRequest:
        raw = orjson.dumps(params.prompt_ids)
        seed = params.seed if params.seed is not None else self.config.seed
        out_seed = xxhash.xxh64_intdigest(raw, seed & 0xFFFFFFFFFFFFFFFF)
        kv = params.kv_transfer_params or {}
        return SimRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=params.prompt_ids,
            max_tokens=params.max_tokens,
            output_plan=self.engine.tokenizer.generate(params.max_tokens, out_seed, params.chat),
            cache_salt=params.cache_salt,
            remote_prefill=bool(kv.get("do_remote_prefill")),
            remote_decode=bool(kv.get("do_remote_decode")),
        )

    # -- tokenizer endpoints --------------------------------------------------------------

    async def _prompt_of(self, request: Request) -> tuple[dict[str, Any], list[int]]:
        body = p.parse_json(await request.body())
        p.resolve_model(body, self.config)
        if "messages" in body:
            return body, p.chat_prompt_ids(body, self.engine.tokenizer)
        return body, p.completion_prompt_ids(body, self.engine.tokenizer)

    async def tokenize(self, request: Request) -> Response:
        try:
            body, ids = await self._prompt_of(request)
        except p.ApiError as err:
            return error_response(err)
        strs = None
        if body.get("return_token_strs"):
            strs = [self.engine.tokenizer.piece(i) for i in ids]
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            body = p.parse_json(await request.body())
            p.resolve_model(body, self.config)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise p.ApiError("'tokens' must be a list of integers.", param="tokens")
        except p.ApiError as err:
            return error_response(err)
        return json_response({"prompt": self.engine.tokenizer.decode(tokens)})

    async def render_chat(self, request: Request) -> Response:
        try:
            body = p.parse_json(await request.body())
            p.resolve_model(body, self.config)
            ids = p.chat_prompt_ids(body, self.engine.tokenizer)
        except p.ApiError as err:
            return error_response(err)
        return json_response(self._rendered(ids))

    async def render_completion(self, request: Request) -> Response:
        try:
            body = p.parse_json(await request.body())
            p.resolve_model(body, self.config)
            ids = p.completion_prompt_ids(body, self.engine.tokenizer)
        except p.ApiError as err:
            return error_response(err)
        return json_response([self._rendered(ids)])

    def _rendered(self, ids: list[int]) -> dict[str, Any]:
        return {
            "token_ids": ids,
            "prompt_token_ids": ids,
            "count": len(ids),
            "prompt": self.engine.tokenizer.decode(ids),
            "features": None,
        }

    # -- info, health, metrics ---------------------------------------------------------

    async def models(self, request: Request) -> Response:
        created = p.now_s()
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
                "permission": [],
            }
            for name in self.config.model_names
        ]
        return json_response({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": SIM_VERSION})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.engine.reset_prefix_cache()
        return Response(status_code=200)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def model_info(self, request: Request) -> Response:
        return json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "max_model_len": self.config.max_model_len,
            }
        )

    async def server_info(self, request: Request) -> Response:
        info: dict[str, Any] = {k: v for k, v in vars(self.config).items()}
        info["served_model_names"] = list(self.config.model_names)
        info["version"] = SIM_VERSION
        info["internal_states"] = [self.engine.state()]
        return json_response(info)

    async def loads(self, request: Request) -> Response:
        engine = self.engine
        used = (engine.kv.num_blocks - engine.kv.num_free_blocks) * engine.kv.block_size
        load = {
            "dp_rank": 0,
            "num_reqs": len(engine.running) + len(engine.waiting),
            "num_running_reqs": len(engine.running),
            "num_waiting_reqs": len(engine.waiting),
            "num_used_tokens": used,
            "token_usage": engine.kv.usage,
        }
        return json_response({"loads": [load], **load})

    async def state(self, request: Request) -> Response:
        return json_response(self.engine.state())

    async def set_faults(self, request: Request) -> Response:
        try:
            body = p.parse_json(await request.body())
            rate = float(body.get("fail_rate", 0.0))
            status = int(body.get("status", 500))
            delay = float(body.get("delay_ms", 0.0))
            if not 0.0 <= rate <= 1.0 or not 100 <= status <= 599 or delay < 0:
                raise ValueError("out of range")
        except (p.ApiError, TypeError, ValueError) as exc:
            return error_response(p.ApiError(f"Invalid faults: {exc}"))
        self.faults = Faults(rate, status, delay, bool(body.get("hang", False)))
        return json_response(vars(self.faults))

    async def clear_faults(self, request: Request) -> Response:
        self.faults = Faults()
        return json_response(vars(self.faults))


def create_app(
    config: SimConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    engine_id: str = "",
    kv_events_port: int | None = None,
    kv_events_replay_port: int | None = None,
) -> Starlette:
    """A Starlette app for one replica; its ``SimServer`` is at ``app.state.sim``.

    ``host``/``port`` are what the replica advertises in ``kv_transfer_params`` and in its KV
    events topic; ``kv_events_port`` (0 = ephemeral) turns the events publisher on.
    """
    sim = SimServer(config, host, port, engine_id, kv_events_port, kv_events_replay_port)

    async def internal_error(request: Request, exc: Exception) -> Response:
        # Only a simulator bug lands here; answer in the OpenAI shape all the same.
        return error_response(p.ApiError(f"Internal error: {exc!r}", status=500))

    app = Starlette(routes=sim.routes(), exception_handlers={Exception: internal_error})
    app.state.sim = sim
    return app
