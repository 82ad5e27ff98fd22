"""The gateway's one HTTP/1.1 client, for every call it makes: to the replicas (pooled
keep-alive connections, responses streamed back unbuffered), and for the monitor's scrapes,
Kubernetes discovery (TLS) and the HTTP tokenizer (small answers read whole).
"""
