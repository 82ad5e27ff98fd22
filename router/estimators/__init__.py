"""What the gateway learns online from its own traffic: each endpoint's prefill speed
(calibration), how wrong its first-byte predictions run, bytes per token, session lengths,
answer sizes and the sessions live on each endpoint. Pure state updated after each pick; no I/O.
"""
