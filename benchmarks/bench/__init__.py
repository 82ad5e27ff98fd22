"""``prefixgate bench``: workloads x routing strategies x peer routers on simulated replicas.

Modules: ``cli`` (flags), ``runner`` (replicas, targets in turn, cache resets), ``targets``
(prefixgate strategies, Redis-backed gateway pair, peer routers), ``client`` (the streaming
load generator), ``conversation`` (incremental prompts, reuse ledger), ``metrics``,
``report`` and ``plots``.
"""
