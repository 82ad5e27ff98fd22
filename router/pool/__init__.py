"""The endpoints the gateway can route to: discovery (static, Kubernetes), the metrics scraper and
health monitor, and the gateway's own Prometheus metrics of the pool.
"""
