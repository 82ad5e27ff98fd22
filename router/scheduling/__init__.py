"""Choosing an endpoint: the plugin registry and profile assembly, filters, pickers and producers,
the router that gathers state, scores and picks, then records the pick, and prefill/decode
disaggregation.
"""
