"""Running the gateway as processes: the uvicorn server (with the gateway's own HTTP protocol:
a response's head and body in one write, disconnects reported by callback), the multi-worker
supervisor and its workers, their metrics, and the private Redis the workers share.
"""
