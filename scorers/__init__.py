"""Scorers: one per module, pure functions of a request and endpoint snapshots to [0, 1]."""
