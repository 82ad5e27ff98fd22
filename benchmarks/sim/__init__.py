"""A simulated vLLM OpenAI-compatible server for routing benchmarks and gateway tests.

Modules: ``config`` (SimConfig), ``tokenizer`` (deterministic tokenizer and chat template),
``kv_cache`` (prefix cache), ``request`` and ``engine`` (step-based batching), ``metrics``
(Prometheus), ``protocol`` and ``server`` (HTTP API), ``anthropic_api`` (Messages API),
``responses_api`` and ``responses_output`` (Responses API), ``cli`` (flags, ``run``,
``start_replicas``).
"""

from .cli import Replica, add_arguments, config_from_args, run, start_replicas
from .config import SimConfig
from .tokenizer import Tokenizer, render_chat

__all__ = [
    "Replica",
    "SimConfig",
    "Tokenizer",
    "add_arguments",
    "config_from_args",
    "render_chat",
    "run",
    "start_replicas",
]
