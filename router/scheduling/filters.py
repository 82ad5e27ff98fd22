"""Role filters: the prefill pool and the decode pool of a disaggregated fleet (issue 5).

An endpoint's role (config, or the pod label ``llm-d.ai/role``) is ``prefill``, ``decode`` or
``both``. A ``both`` endpoint belongs to either pool, so a fleet that is not split at all still
has a full decode pool and a full prefill pool. The plugin names are llm-d's.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot, Role
from router.core.framework import RoutingRequest

PREFILL_ROLES: frozenset[Role] = frozenset({"prefill", "both"})
DECODE_ROLES: frozenset[Role] = frozenset({"decode", "both"})
PREFILL_FILTER = "prefill-filter"
DECODE_FILTER = "decode-filter"


class RoleFilter:
    """Keeps the endpoints whose role is one of ``roles``."""

    def __init__(self, type_name: str, roles: frozenset[Role]) -> None:
        self.type_name = type_name
        self.roles = roles

    def filter(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[EndpointSnapshot]:
        return [e for e in endpoints if e.role in self.roles]

    def __repr__(self) -> str:
        return f"RoleFilter({self.type_name!r})"


def prefill_filter() -> RoleFilter:
    return RoleFilter(PREFILL_FILTER, PREFILL_ROLES)


def decode_filter() -> RoleFilter:
    return RoleFilter(DECODE_FILTER, DECODE_ROLES)
