"""What the agent-API dialects need of the replica serving them.

``SimServer`` satisfies it; the dialect modules type against this Protocol so they do not
import the server that routes to them (no import circle).
"""

from __future__ import annotations

from typing import Any, Protocol

from starlette.responses import Response

from . import protocol as p
from .config import SimConfig
from .engine import Engine
from .request import SimRequest
from .responses_output import ResponseStore


class SimHost(Protocol):
    config: SimConfig
    engine: Engine
    responses: ResponseStore

    def transfer_params(self, req: SimRequest) -> dict[str, Any]: ...

    async def injected_fault(self) -> Response | p.ApiError | None: ...

    def capacity_error(self, params: p.GenerationParams) -> p.ApiError | None: ...

    def new_request(self, params: p.GenerationParams) -> SimRequest: ...
