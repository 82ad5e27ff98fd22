"""Where each endpoint publishes its KV events: configured per endpoint, or derived."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EventSource:
    endpoint_id: str
    address: str
    replay_address: str | None = None


def derive_sources(
    endpoint_urls: Mapping[str, str],
    addresses: Mapping[str, str],
    replay_addresses: Mapping[str, str],
    port: int | None,
    port_offset: int | None,
    replay_port: int | None = None,
    replay_port_offset: int | None = None,
) -> list[EventSource]:
    """Each endpoint's events address: configured per endpoint, else host + port (or offset).

    ``endpoint_urls`` maps endpoint id (``host:port``) to URL; endpoints without an address
    get no subscriber and are always scored from the approximate index.
    """
    sources = []
    for eid in endpoint_urls:
        host, _, http_port = eid.rpartition(":")
        address = addresses.get(eid) or _derived(host, http_port, port, port_offset)
        if address is None:
            continue
        replay = replay_addresses.get(eid) or _derived(
            host, http_port, replay_port, replay_port_offset
        )
        sources.append(EventSource(eid, address, replay))
    return sources


def _derived(host: str, http_port: str, port: int | None, offset: int | None) -> str | None:
    if port is not None:
        return f"tcp://{host}:{port}"
    if offset is not None:
        return f"tcp://{host}:{int(http_port) + offset}"
    return None
