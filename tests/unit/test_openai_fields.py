"""Request fields the OpenAI-compatible API does not know are left out and logged once, as
vLLM's server does; a known field set to what it cannot do is still refused."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from coordinator.openai_api import OpenAIApi
from coordinator.openai_schema import ApiError, parse_body


def test_unknown_fields_are_left_out_and_named():
    parsed = parse_body({"prompt": "a", "max_tokens": 3, "frobnicate": 1, "guided_json": {}}, chat=False)
    assert parsed.ignored == ("frobnicate", "guided_json")
    plain = parse_body({"prompt": "a", "max_tokens": 3}, chat=False)
    assert parsed.request == plain.request and plain.ignored == ()


@pytest.mark.parametrize(
    "body, field", [({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "best_of": 2}, "best_of")]
)
def test_a_known_field_the_server_cannot_honour_is_still_refused(body, field):
    with pytest.raises(ApiError) as error:
        parse_body(body, chat=False)
    assert (error.value.status, error.value.param) == (400, field)


def test_each_ignored_field_is_logged_once(caplog):
    api = OpenAIApi(cast(Any, None), "m")
    with caplog.at_level(logging.WARNING, logger="coordinator.openai_api"):
        for _ in range(3):
            api._warn_ignored(("frobnicate",))
        api._warn_ignored(("frobnicate", "other"))
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "ignoring request fields this server does not know: 'frobnicate'",
        "ignoring request fields this server does not know: 'other'",
    ]
