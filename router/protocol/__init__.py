"""What a client's request says: the OpenAI, Anthropic Messages and Responses API dialects parsed
and rendered into one prompt, the header policy (what may go upstream, what comes back), tenant
keys and agents' session identities.
"""
