"""The Envoy ext_proc endpoint picker: the gRPC service that reads Envoy's request messages, picks
an endpoint with the same scheduler and answers with the destination header.
"""
