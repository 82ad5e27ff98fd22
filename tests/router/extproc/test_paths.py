"""What a request's path tells the endpoint picker (router/extproc/paths.py)."""

from __future__ import annotations

import pytest

from router.extproc.paths import api_for, stored_response_id


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/chat/completions?stream=true", "chat"),
        ("/v1/completions", "completions"),
        ("/v1/messages", "messages"),
        ("/v1/messages?beta=true", "messages"),
        ("/v1/responses", "responses"),
        ("/v1/responses/resp_1", None),
        ("/v1/models", None),
        ("/health", None),
    ],
)
def test_api_for_reads_the_path_without_its_query_or_trailing_slash(
    path: str, api: str | None
) -> None:
    assert api_for(path) == api


@pytest.mark.parametrize(
    ("path", "response_id"),
    [
        ("/v1/responses/resp_1", "resp_1"),
        ("/v1/responses/resp_1/", "resp_1"),
        ("/v1/responses/resp_1?include=x", "resp_1"),
        ("/v1/responses/resp_1/cancel", "resp_1"),
        ("/v1/responses", None),
        ("/v1/chat/completions", None),
    ],
)
def test_stored_response_id_names_the_response_a_path_is_about(
    path: str, response_id: str | None
) -> None:
    assert stored_response_id(path) == response_id
