"""prefixgate: a prefix-aware routing gateway for vLLM inference fleets."""

__version__ = "0.1.0"
