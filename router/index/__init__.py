"""Where the gateway remembers what each endpoint has cached and where each session lives: the
approximate prefix index, session affinity and Responses API routes, in memory or shared through
Redis (the link, its scripts and the off-path update queue), and the sizing of each endpoint's
index from its KV capacity.
"""
