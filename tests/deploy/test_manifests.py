"""Every manifest under deploy/ parses and validates against its schema; the pieces fit together.

Core kinds are checked with kubernetes-validate (the Kubernetes OpenAPI schemas, strict: an
unknown field fails); InferencePool against the openAPIV3Schema of the CRD shipped in
deploy/crds; HTTPRoute and ServiceMonitor against the subset of their CRD schemas written out
in tests/deploy/schemas.py; the Envoy bootstrap against Envoy's own protobuf types; the Grafana
dashboard against the metrics prefixgate really exports. ``kubectl kustomize`` renders each base
when kubectl is here.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2,
)
from envoy.extensions.load_balancing_policies.override_host.v3 import (
    override_host_pb2,
)
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from router.app import build_gateway
from router.config.model import parse_config
from router.extproc.metrics import ExtProcMetrics
from router.extproc.server import EXT_PROC_SERVICE
from router.index.redis_link import RedisMetrics
from tests.deploy.schemas import CUSTOM_SCHEMAS, DEPLOY

# The oldest Kubernetes the manifests claim (gRPC probes, appProtocol, policy/v1), and the newest.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
NOT_MANIFESTS = {DEPLOY / "envoy" / "envoy.yaml"}



def manifest_files() -> list[Path]:
    files = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")
    return [p for p in files if p not in NOT_MANIFESTS]


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate(doc: dict[str, Any]) -> None:
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    schema = CUSTOM_SCHEMAS.get(key)
    if schema is not None:
        jsonschema.validate(doc, schema)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def all_docs() -> list[dict[str, Any]]:
    return [d for p in manifest_files() for d in load_docs(p.read_text())]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_validates(path: Path) -> None:
    docs = load_docs(path.read_text())
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        validate(doc)


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


@pytest.mark.parametrize("base", kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_renders(base: Path) -> None:
    spec = yaml.safe_load((base / "kustomization.yaml").read_text())
    listed = list(spec.get("resources", []))
    for generator in spec.get("configMapGenerator", []):
        listed += generator.get("files", [])
    for item in listed:
        assert (base / item).exists(), f"{base}/kustomization.yaml names missing {item}"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    done = subprocess.run(
        [kubectl, "kustomize", str(base)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    rendered = load_docs(done.stdout)
    assert rendered
    for doc in rendered:
        validate(doc)


def test_crd_schema_refuses_bad_pools() -> None:
    good = find("InferencePool", "vllm-pool")
    schema = CUSTOM_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")]
    jsonschema.validate(good, schema)
    bad_specs = [
        {"targetPorts": []},
        {"targetPorts": [{"number": p} for p in range(8000, 8009)]},
        {"targetPorts": [{"number": 0}]},
        {"endpointPickerRef": {"name": "x", "failureMode": "Sometimes"}},
        {"selector": {"app": "vllm"}},  # the v1alpha2 shape
        {"targetPortNumber": 8000},
    ]
    for change in bad_specs:
        doc = copy.deepcopy(good)
        doc["spec"].update(change)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def prefixgate_config(configmap: str) -> Any:
    return parse_config(yaml.safe_load(find("ConfigMap", configmap)["data"]["config.yaml"]))


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = container
    return result


def test_endpoint_picker_fits_together() -> None:
    config = prefixgate_config("prefixgate-epp-config")
    assert config.ext_proc.host == "0.0.0.0"
    assert config.discovery is not None and config.discovery.inference_pool == "vllm-pool"
    deployment = find("Deployment", "prefixgate-epp")
    container = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ext = config.ext_proc
    assert ports == {"grpc": ext.port, "grpc-health": ext.health_port, "metrics": ext.metrics_port}
    assert container["livenessProbe"]["grpc"] == {"port": ext.health_port, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {
        "port": ext.health_port,
        "service": "readiness",
    }
    assert container["args"][:3] == ["epp", "--config", "/etc/prefixgate/config.yaml"]
    service = find("Service", "prefixgate-epp")
    pool = find("InferencePool", "vllm-pool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    service_ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert service_ports[ref["port"]["number"]]["targetPort"] == "grpc"
    assert service_ports[ref["port"]["number"]]["appProtocol"] == "http2"
    route = find("HTTPRoute", "vllm")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "vllm-pool")
    rules = find("Role", "prefixgate-epp")["rules"]
    granted = {
        (g, r): set(rule["verbs"])
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert {"get", "list", "watch"} <= granted[("", "pods")]
    assert {"get", "list", "watch"} <= granted[("inference.networking.k8s.io", "inferencepools")]
    # A rollout must not cut answers still streaming through the picker: preStop, drain and
    # grace fit the pod's termination grace period.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown = float(pre_stop[1]) + ext.shutdown_drain_seconds + ext.shutdown_grace_seconds
    assert shutdown < deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert ext.shutdown_grace_seconds >= 30, "long answers need more than seconds to end"


def test_standalone_gateway_fits_together() -> None:
    config = prefixgate_config("prefixgate-config")
    assert config.server.host == "0.0.0.0"
    assert config.discovery is not None and config.discovery.label_selector == {"app": "vllm"}
    container = _container(find("Deployment", "prefixgate"))
    assert container["args"][0] == "serve"
    assert container["ports"][0]["containerPort"] == config.server.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    sim = find("Deployment", "vllm-sim")
    labels = sim["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in config.discovery.label_selector.items())
    assert _container(sim)["ports"][0]["containerPort"] in config.discovery.target_ports
    redis = find("Service", "prefixgate-redis")
    assert (
        config.prefix_index.url == f"redis://prefixgate-redis:{redis['spec']['ports'][0]['port']}/0"
    )


@pytest.mark.parametrize("name", ["prefixgate-epp", "prefixgate"])
def test_replicated_deployments_survive_disruption(name: str) -> None:
    deployment = find("Deployment", name)
    assert deployment["spec"]["replicas"] >= 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = find("PodDisruptionBudget", name)
    assert pdb["spec"]["minAvailable"] >= 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    keys = {c["topologyKey"] for c in spread}
    assert "kubernetes.io/hostname" in keys
    for c in spread:
        assert c["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    service = find("Service", name)
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_every_container_has_resources_and_probes() -> None:
    for doc in all_docs():
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            where = f"{doc['metadata']['name']}/{container['name']}"
            assert container["resources"]["requests"], where
            assert container["resources"]["limits"]["memory"], where
            assert "readinessProbe" in container, where


def test_envoy_bootstrap_is_valid_and_asks_the_picker() -> None:
    data = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    bootstrap = json_format.ParseDict(data, bootstrap_pb2.Bootstrap())  # unknown fields fail
    listener = bootstrap.static_resources.listeners[0]
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ext = ext_proc_pb2.ExternalProcessor()
    hcm.http_filters[0].typed_config.Unpack(ext)
    mode = ext.processing_mode
    duplex = mode.FULL_DUPLEX_STREAMED
    assert (mode.request_body_mode, mode.response_body_mode) == (duplex, duplex)
    # Envoy refuses FULL_DUPLEX_STREAMED bodies unless trailers are sent too.
    assert mode.request_trailer_mode == mode.SEND and mode.response_trailer_mode == mode.SEND
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    epp = clusters[ext.grpc_service.envoy_grpc.cluster_name]
    lb_endpoint = epp.load_assignment.endpoints[0].lb_endpoints[0].endpoint
    config = prefixgate_config("prefixgate-epp-config")
    assert lb_endpoint.address.socket_address.port_value == config.ext_proc.port
    assert lb_endpoint.health_check_config.port_value == config.ext_proc.health_port
    assert epp.health_checks[0].grpc_health_check.service_name == EXT_PROC_SERVICE
    assert ext.message_timeout.seconds > config.flow_control.default_request_ttl
    override = override_host_pb2.OverrideHost()
    policy = clusters["model-servers"].load_balancing_policy.policies[0]
    policy.typed_extension_config.typed_config.Unpack(override)
    metadata = [s.metadata for s in override.override_host_sources if s.HasField("metadata")]
    assert metadata[0].key == "envoy.lb"
    assert metadata[0].path[0].key == "x-gateway-destination-endpoint"
    # Envoy drops a processor's dynamic metadata of any namespace not listed as received.
    assert "envoy.lb" in ext.metadata_options.receiving_namespaces.untyped
    # The port Envoy health-checks the picker on is one its Service exposes.
    service = find("Service", lb_endpoint.address.socket_address.address)
    exposed = {p["port"] for p in service["spec"]["ports"]}
    assert {lb_endpoint.address.socket_address.port_value,
            lb_endpoint.health_check_config.port_value} <= exposed


def test_envoy_cuts_no_answer_the_gateway_would_let_finish() -> None:
    """A route's timeout (Envoy's, and an HTTPRoute's ``timeouts.request``) spans the whole
    answer, a long streamed one included; the gateway bounds only the wait for the first byte
    and the silences. So the total is off ("0s"; unset, Envoy's is 15 s) and Envoy's stream
    idle timeout covers the first byte's wait."""
    data = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    bootstrap = json_format.ParseDict(data, bootstrap_pb2.Bootstrap())
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    config = prefixgate_config("prefixgate-epp-config")
    assert hcm.stream_idle_timeout.seconds >= config.proxy.first_byte_timeout_seconds
    for host in hcm.route_config.virtual_hosts:
        for route in host.routes:
            assert route.route.HasField("timeout"), route.match
            assert route.route.timeout.ToTimedelta().total_seconds() == 0, route.match
    for rule in find("HTTPRoute", "vllm")["spec"]["rules"]:
        assert rule.get("timeouts", {}).get("request") == "0s"


def exported_metric_names() -> set[str]:
    gateway = build_gateway(parse_config({"pool": {"endpoints": [{"url": "http://127.0.0.1:9"}]}}))
    registry = gateway.metrics.registry
    ExtProcMetrics(registry)
    RedisMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        base = family.name
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names |= {base + s for s in suffixes.get(family.type, [""])}
    return names


def test_grafana_dashboard_shows_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"prefixgate_[a-z0-9_]+", e)}
    assert used, "the dashboard queries nothing"
    unknown = used - exported_metric_names()
    assert not unknown, f"the dashboard queries metrics prefixgate does not export: {unknown}"
    assert {"prefixgate_extproc_decisions_total", "prefixgate_requests_total"} <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# Envoy's defaults when a cluster sets no circuit breakers: 1024 connections, pending requests
# and requests, 3 concurrent retries.
ENVOY_DEFAULT_CIRCUIT_LIMIT = 1024
ENVOY_DEFAULT_MAX_RETRIES = 3


def test_envoy_circuit_breakers_do_not_turn_away_what_the_picker_holds() -> None:
    """Each HTTP request holds one ext_proc stream (one request on the picker's cluster) for its
    whole life, queued in flow control included, and one request on the model servers' cluster:
    Envoy's default circuit breakers would answer the 1025th with a 503 of its own (and the
    picker's stream failing, failure_mode_allow false, with a 500) instead of the picker's 429,
    and allow only 3 concurrent retries to the destination list's fallback (GIE's standalone
    Envoy raises them on both clusters)."""
    data = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    bootstrap = json_format.ParseDict(data, bootstrap_pb2.Bootstrap())
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    config = prefixgate_config("prefixgate-epp-config")
    queued = config.flow_control.max_requests
    for name in ("prefixgate-epp", "model-servers"):
        thresholds = clusters[name].circuit_breakers.thresholds
        assert thresholds, f"{name}: Envoy's defaults ({ENVOY_DEFAULT_CIRCUIT_LIMIT})"
        default = thresholds[0]
        for field in ("max_connections", "max_pending_requests", "max_requests"):
            assert default.HasField(field), f"{name}: {field} left at Envoy's default"
            assert getattr(default, field).value > queued, (name, field)
    retries = clusters["model-servers"].circuit_breakers.thresholds[0]
    assert retries.HasField("max_retries")
    assert retries.max_retries.value > ENVOY_DEFAULT_MAX_RETRIES
