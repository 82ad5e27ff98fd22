"""Running the gateway as processes: the uvicorn server, the multi-worker supervisor and its
workers, their metrics, and the private Redis the workers share.
"""
