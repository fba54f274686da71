"""Request fields the OpenAI-compatible API does not know are left out and logged once, as
vLLM's server does; a known field set to what it cannot do is still refused; an unset
max_tokens is the rest of the context, as vLLM's."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.openai_api import OpenAIApi
from coordinator.openai_schema import ApiError, parse_body
from coordinator.requests import GenerationRequest, prepare_job
from specdec.tools.testing import byte_level_tokenizer
from tests.unit.test_rounds import PAIR


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


@pytest.mark.parametrize(
    "body, limit, expected",
    [
        ({"prompt": "abc"}, 2048, PAIR.max_context - 3),  # the rest of the context after 3 prompt tokens
        ({"prompt": "abc"}, 20, 20),  # ... within --max-new-tokens-limit
        ({"prompt": "abc", "max_tokens": 5}, 2048, 5),
        ({"prompt": "abc", "max_completion_tokens": 7}, 2048, 7),
    ],
)
def test_an_unset_max_tokens_is_the_rest_of_the_context(body, limit, expected):
    config = CoordinatorConfig(
        draft_address="d:1", target_address="t:1", tokenizer="t", max_new_tokens_limit=limit, default_max_new_tokens=8
    )
    tokenizer = byte_level_tokenizer()
    job = prepare_job(parse_body(body, chat=False).request, config, PAIR, tokenizer)
    assert job.max_new_tokens == expected
    # The gRPC API's unset max_new_tokens stays the server's default_max_new_tokens (64).
    grpc_request = dataclasses.replace(GenerationRequest(prompt="abc"), max_new_tokens=None)
    assert prepare_job(grpc_request, config, PAIR, tokenizer).max_new_tokens == 8
