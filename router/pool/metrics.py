"""The gateway's own Prometheus metrics, on a registry owned by the app (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.core.histogram import LoopHistogram
from router.core.pool import EndpointPool

_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
# From milliseconds (a warm cache, an idle replica) to a long prompt queued behind others.
_FIRST_BYTE_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0
)
_GATEWAY_DELAY_BUCKETS = (*_DECISION_BUCKETS, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The endpoint label of requests answered without one (none was picked or reached).
NO_ENDPOINT = "none"
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self, pool: EndpointPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pool = pool
        self._labelled: set[str] = set()  # endpoints the per-endpoint gauges have labels for
        # The requests counter's children by label values: ``labels`` validates the values,
        # builds its key and takes a lock on every call, once per request.
        self._request_children: dict[tuple[str, int | str, str], Counter] = {}
        self._add_traffic(self.registry)
        self._add_failures(self.registry)
        self._add_endpoint_gauges(self.registry)

    def _add_traffic(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "prefixgate_requests",
            "Requests answered, by endpoint (or 'none') and HTTP status.",
            ["endpoint", "status", "api"],
            registry=r,
        )
        self.decision_seconds = LoopHistogram(
            "prefixgate_routing_decision_seconds",
            "Time to pick an endpoint: index lookup, scoring and picking.",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        # Split a client's time to first token into the gateway's part and the endpoint's:
        # the first is gateway_delay, the second first_byte minus it.
        self.gateway_delay = LoopHistogram(
            "prefixgate_request_gateway_delay_seconds",
            "From a request's arrival to its routing: body read, flow-control queueing and "
            "the routing decision.",
            buckets=_GATEWAY_DELAY_BUCKETS,
            registry=r,
        )
        self.first_byte = LoopHistogram(
            "prefixgate_time_to_first_byte_seconds",
            "From a request's arrival to the first byte of the endpoint's answer, retries "
            "included.",
            buckets=_FIRST_BYTE_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "prefixgate_event_loop_lag_seconds",
            "How late the gateway's event loop ran a timer: time every ready callback waited "
            "for the CPU.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.prefix_match_ratio = LoopHistogram(
            "prefixgate_prefix_match_ratio",
            "Share of the request's prompt blocks the chosen endpoint was estimated to hold.",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )

    def count_request(self, endpoint: str, status: int | str, api: str) -> None:
        """One answered request in ``prefixgate_requests``."""
        key = (endpoint, status, api)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(endpoint, str(status), api)
        child.inc()

    def _add_failures(self, r: CollectorRegistry) -> None:
        self.upstream_failures = Counter(
            "prefixgate_upstream_failures",
            "Attempts that failed before a response started, by endpoint and kind.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "prefixgate_retries", "Requests retried on another endpoint.", registry=r
        )
        self.stream_errors = Counter(
            "prefixgate_stream_errors",
            "Responses cut short by an upstream failure after the first byte.",
            ["endpoint"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "prefixgate_client_disconnects",
            "Requests whose client went away; the upstream request was cancelled.",
            registry=r,
        )

    def _add_endpoint_gauges(self, r: CollectorRegistry) -> None:
        self.in_flight = Gauge(
            "prefixgate_endpoint_in_flight",
            "Requests the gateway has in flight to each endpoint.",
            ["endpoint"],
            registry=r,
        )
        self.healthy = Gauge(
            "prefixgate_endpoint_healthy", "1 if the endpoint is healthy.", ["endpoint"], registry=r
        )
        self.waiting = Gauge(
            "prefixgate_endpoint_waiting",
            "Last scraped vllm:num_requests_waiting.",
            ["endpoint"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "prefixgate_endpoint_kv_usage",
            "Last scraped vllm:kv_cache_usage_perc.",
            ["endpoint"],
            registry=r,
        )

        self.slot_limit = Gauge(
            "prefixgate_endpoint_slot_limit",
            "Learned sequence-slot limit (vLLM's max_num_seqs) of each endpoint, 0 while "
            "unknown or unconfirmed for a minute.",
            ["endpoint"],
            registry=r,
        )

    def render(self) -> bytes:
        # Per-endpoint gauges are refreshed at scrape time: cheaper than on every request.
        # An endpoint that has left the pool leaves them too (a pod gone would read healthy
        # for good, and churn would pile up labels), and its counters with them.
        present = {state.endpoint.id for state in self._pool}
        for gone in self._labelled - present:
            for gauge in (
                self.in_flight, self.healthy, self.waiting, self.kv_usage, self.slot_limit
            ):
                gauge.remove(gone)
        self._labelled = present
        self._forget_counters(present)
        for state in self._pool:
            eid = state.endpoint.id
            self.in_flight.labels(eid).set(state.in_flight)
            self.healthy.labels(eid).set(1 if state.healthy else 0)
            self.waiting.labels(eid).set(state.metrics.waiting)
            self.kv_usage.labels(eid).set(state.metrics.kv_usage)
            slots = state.slots
            self.slot_limit.labels(eid).set(slots.limit if slots.live(self._pool.clock()) else 0)
        return generate_latest(self.registry)

    def _forget_counters(self, present: set[str]) -> None:
        """Drop the counter series of endpoints no longer in the pool (those of requests
        still draining there too, counted after an earlier render): pods come back under
        new addresses, so they would pile up for the gateway's lifetime. One that returns
        starts at 0 again, a reset that rate() reads as one."""
        keep = present | {NO_ENDPOINT}
        for key in [k for k in self._request_children if k[0] not in keep]:
            del self._request_children[key]
            self.requests.remove(key[0], str(key[1]), key[2])
        per_endpoint = (
            (self.stream_errors, ("endpoint",)),
            (self.upstream_failures, ("endpoint", "kind")),
        )
        for counter, names in per_endpoint:
            gone = {
                tuple(sample.labels[name] for name in names)
                for family in counter.collect()
                for sample in family.samples
                if sample.labels["endpoint"] not in keep
            }
            for labels in gone:
                counter.remove(*labels)
