"""Precise prefix routing: the replicas' KV-cache events received over ZMQ, the precise index (in
memory or in Redis) and the tokenizers that turn prompts into the engine's block keys.
"""
