"""The logfmt text of log fields (router/api/logfmt.py)."""

from __future__ import annotations

from router.api.logfmt import Words, access_logfmt
from router.protocol.exchange import Exchange


def test_a_text_line_quotes_what_needs_it_each_time_past_the_words_bound() -> None:
    words = Words(size=3)
    lines = [
        access_logfmt(Exchange("chat", "r", 0.0, model=model), 1.0, words)
        for model in ["a b", "m1", "m2", "m3", "a b"]
    ]
    assert [line.split(" ")[2:4] for line in (lines[0], lines[-1])] == [['model="a', 'b"']] * 2
    assert "model=m3" in lines[3]
