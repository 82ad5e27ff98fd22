"""The HTTP face of the gateway: the lean ASGI application for the inference routes, the proxy that
admits, routes and forwards a request, the streaming relay, the requests' timeouts on one tick,
stored Responses, the access log and the event-loop lag monitor.
"""
