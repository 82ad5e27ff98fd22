"""The vocabulary every layer shares: errors, block hashing, endpoints and their live state, the
scheduling framework's request type and plugin Protocols, the strict config base, and small task
and container helpers. Nothing here imports from the rest of the gateway.
"""
