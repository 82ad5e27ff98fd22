"""The gateway's configuration: strict pydantic models that fail at start-up naming the bad key,
the built-in strategies as plain config, and the translation of llm-d's EndpointPickerConfig
into prefixgate's.
"""
