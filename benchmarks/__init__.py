"""Benchmark tooling for prefixgate: the vLLM replica simulator and load drivers."""
