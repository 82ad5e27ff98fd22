"""The ``prefixgate`` command: ``serve``, ``epp``, ``sim`` and ``demo``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from router.api.logs import make_formatter
from router.config.model import GatewayConfig, load_config, parse_config
from router.core.endpoints import endpoint_id_from_url
from router.core.errors import ConfigError

# logging's and uvicorn's names; anything else is a usage error, not a traceback.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _serve_config(args: argparse.Namespace) -> GatewayConfig:
    if args.config:
        config = load_config(args.config)
    elif args.backend:
        config = parse_config({})
    else:
        raise ConfigError("serve needs --config FILE or at least one --backend URL")
    data = config.model_dump(by_alias=True, exclude_unset=True)
    if args.backend:
        _add_backends(data, args.backend)
    server = data.setdefault("server", {})
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.workers is not None:
        server["workers"] = args.workers
    if args.strategy:
        data.pop("plugins", None)
        data.pop("schedulingProfiles", None)
        data["strategy"] = args.strategy
    return _with_endpoints(parse_config(data))


def _with_endpoints(config: GatewayConfig) -> GatewayConfig:
    """A gateway with no endpoint and no discovery could only answer 503: refuse to start."""
    if not config.pool.endpoints and config.discovery is None:
        raise ConfigError(
            "pool.endpoints: no endpoints to route to (give pool.endpoints, --backend URL "
            "or discovery)"
        )
    return config


def _add_backends(data: dict[str, Any], backends: Sequence[str]) -> None:
    """``--backend`` URLs join the config's pool (a config from llm-d names none: its
    endpoints come from an InferencePool); one the pool already lists is not added twice."""
    endpoints = data.setdefault("pool", {}).setdefault("endpoints", [])
    known = {endpoint_id_from_url(e["url"]) for e in endpoints}
    for url in backends:
        try:
            endpoint_id = endpoint_id_from_url(url)
        except ValueError as exc:
            raise ConfigError(f"--backend: {exc}") from exc
        if endpoint_id not in known:
            known.add(endpoint_id)
            endpoints.append({"url": url})


def _cmd_serve(args: argparse.Namespace) -> int:
    from router.serve.server import serve

    config = _serve_config(args)
    if config.server.workers > 1:
        from router.serve.supervisor import supervise

        return supervise(config, args.log_level, args.log_format)
    serve(config, args.log_level, args.log_format)
    return 0


def _epp_config(args: argparse.Namespace) -> GatewayConfig:
    config = load_config(args.config)
    data = config.model_dump(by_alias=True, exclude_unset=True)
    ext_proc = data.setdefault("extProc", {})
    for key, value in (("host", args.host), ("port", args.port)):
        if value is not None:
            ext_proc[key] = value
    for key, value in (("healthPort", args.health_port), ("metricsPort", args.metrics_port)):
        if value is not None:
            ext_proc[key] = value
    return parse_config(data)


def _cmd_epp(args: argparse.Namespace) -> int:
    from router.extproc.server import serve_epp

    serve_epp(_epp_config(args))
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from benchmarks.sim.cli import run

    return run(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from router.demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.bench.cli import run as run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.sim.cli import add_arguments as add_sim_arguments

    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML config file (EndpointPickerConfig style)")
    serve.add_argument("--backend", action="append", default=[], help="replica URL (repeat)")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--strategy", default=None, help="built-in strategy instead of plugins")
    serve.add_argument(
        "--workers", type=int, default=None,
        help="processes serving the port (default: server.workers, 1); see docs/scale-out.md",
    )
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    serve.add_argument(
        "--log-format", choices=["text", "json"], default=None,
        help="log lines as text or JSON objects (default: server.logFormat, text)",
    )
    serve.set_defaults(func=_cmd_serve)

    epp = sub.add_parser("epp", help="run as an Envoy ext_proc endpoint picker (Gateway API)")
    epp.add_argument("--config", required=True, help="YAML config file (extProc:, discovery:)")
    epp.add_argument("--host", default=None, help="address for all three ports")
    epp.add_argument("--port", type=int, default=None, help="ext_proc gRPC port (9002)")
    epp.add_argument("--health-port", type=int, default=None, help="gRPC health port (9003)")
    epp.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (9090)")
    epp.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    epp.set_defaults(func=_cmd_epp)

    sim = sub.add_parser("sim", help="run simulated vLLM replicas")
    add_sim_arguments(sim)
    sim.set_defaults(func=_cmd_sim)

    demo = sub.add_parser("demo", help="gateway + 4 simulated replicas on loopback")
    demo.add_argument("--port", type=int, default=8000, help="gateway port")
    demo.add_argument("--replicas", type=int, default=4)
    demo.add_argument("--smoke", action="store_true", help="send a short workload, print, exit")
    demo.add_argument("--strategy", default="default")
    demo.set_defaults(func=_cmd_demo)

    from benchmarks.bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="strategies and peer routers side by side (simulated)")
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The gateway's text formatter, so that an access line carries its fields wherever the
    # gateway runs in-process (``demo``); ``serve`` installs its own handlers over this.
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter("text"))
    logging.basicConfig(level=str(getattr(args, "log_level", "info")).upper(), handlers=[handler])
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
