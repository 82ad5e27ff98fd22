"""The CRD schemas the manifests are validated against, where Kubernetes' own do not apply.

InferencePool from the CRD shipped in deploy/crds; HTTPRoute and ServiceMonitor as the subset
of their CRD schemas that the examples use, with unknown fields refused.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
# The fields of gateway.networking.k8s.io/v1 HTTPRoute that examples use, unknown ones refused.
HTTPROUTE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "maxItems": 32,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "group": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                            "namespace": {"type": "string"},
                            "sectionName": {"type": "string"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        },
                    },
                },
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "matches": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "properties": {
                                                "type": {
                                                    "enum": [
                                                        "Exact",
                                                        "PathPrefix",
                                                        "RegularExpression",
                                                    ]
                                                },
                                                "value": {"type": "string", "pattern": "^/"},
                                            },
                                        },
                                        "headers": {"type": "array"},
                                        "queryParams": {"type": "array"},
                                        "method": {"type": "string"},
                                    },
                                },
                            },
                            "backendRefs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["name"],
                                    "properties": {
                                        "group": {"type": "string"},
                                        "kind": {"type": "string"},
                                        "name": _NAME,
                                        "namespace": {"type": "string"},
                                        "port": {"type": "integer"},
                                        "weight": {"type": "integer", "minimum": 0},
                                    },
                                },
                            },
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"request": DURATION, "backendRequest": DURATION},
                            },
                            "filters": {"type": "array"},
                        },
                    },
                },
            },
        }
    },
}
# The fields of monitoring.coreos.com/v1 ServiceMonitor that deploy/monitoring uses.
SERVICEMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        }
    },
}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "namespace": {"type": "string"}},
}


def _strict(schema: Any) -> Any:
    """The API server prunes unknown fields; a manifest here must not have any (typos)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_schema(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    schema: dict[str, Any] = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = _META
    return schema


def _with_meta(schema: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    out["required"] = ["apiVersion", "kind", "metadata", *out["required"]]
    out["properties"].update(
        apiVersion={"const": api_version}, kind={"const": kind}, metadata=_META
    )
    return out


CUSTOM_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): _crd_schema(
        DEPLOY / "crds" / "inferencepool.yaml"
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _with_meta(
        HTTPROUTE_SCHEMA, "gateway.networking.k8s.io/v1", "HTTPRoute"
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _with_meta(
        SERVICEMONITOR_SCHEMA, "monitoring.coreos.com/v1", "ServiceMonitor"
    ),
}
