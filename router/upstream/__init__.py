"""The gateway's HTTP/1.1 client to the replicas: pooled keep-alive connections behind a small
transport interface, streaming responses back unbuffered.
"""
