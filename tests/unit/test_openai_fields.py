"""Request fields the OpenAI-compatible API does not know are left out and logged once, as
vLLM's server does; a known field set to what it cannot do (vLLM's extras that change the
output included) is still refused; null is a field's default; an unset max_tokens is the rest
of the context, and one past it a 400, as vLLM's."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.openai_api import OpenAIApi
from coordinator.openai_schema import ApiError, api_error, parse_body, parse_request_body, speculation
from coordinator.requests import GenerationRequest, prepare_job
from specdec.errors import InvalidArgument
from specdec.tools.testing import byte_level_tokenizer
from tests.unit.test_rounds import PAIR


def test_unknown_fields_are_left_out_and_named():
    parsed = parse_body({"prompt": "a", "max_tokens": 3, "frobnicate": 1, "prediction": {}}, chat=False)
    assert parsed.ignored == ("frobnicate", "prediction")
    plain = parse_body({"prompt": "a", "max_tokens": 3}, chat=False)
    assert parsed.request == plain.request and plain.ignored == ()


@pytest.mark.parametrize(
    "body, field", [({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "best_of": 2}, "best_of")]
)
def test_a_known_field_the_server_cannot_honour_is_still_refused(body, field):
    with pytest.raises(ApiError) as error:
        parse_body(body, chat=False)
    assert (error.value.status, error.value.param) == (400, field)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["yes", "no"]},
        {"ignore_eos": True},
        {"min_tokens": 50},
        {"stop_token_ids": [5]},
        {"include_stop_str_in_output": True},
        {"min_p": 0.1},
        {"functions": [{"name": "f", "parameters": {}}]},
        {"function_call": "auto"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False},
        {"use_beam_search": True},
        {"skip_special_tokens": False},
        {"modalities": ["text", "audio"]},
        {"audio": {"voice": "alloy", "format": "wav"}},
        {"web_search_options": {}},
    ],
)
def test_a_field_that_would_change_the_output_is_refused_not_dropped(extra):
    """vLLM serves these; dropping them would answer 200 with output the caller did not ask for."""
    with pytest.raises(ApiError) as error:
        parse_body({"messages": [{"role": "user", "content": "hi"}], **extra}, chat=True)
    assert (error.value.status, error.value.param) == (400, next(iter(extra)))
    off = {"guided_json": None, "ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "min_p": 0}
    parse_body({"messages": [{"role": "user", "content": "hi"}], **off}, chat=True)  # "off" values pass


@pytest.mark.parametrize("field", ["stream", "echo", "best_of", "seed", "top_k", "stop", "logit_bias"])
def test_null_is_the_field_s_default(field):
    """The official client sends null for an argument passed as None."""
    assert parse_body({"prompt": "a", field: None}, chat=False) == parse_body({"prompt": "a"}, chat=False)


def test_vllm_s_spellings_of_off_and_of_the_system_turn_are_taken():
    """top_k -1 is vLLM's "off"; a negative seed is its 64 bits; the developer role is
    OpenAI's newer name for the system turn; text parts join with newlines, as vLLM joins them."""
    assert parse_body({"prompt": "a", "top_k": -1}, chat=False).request.top_k == 0
    assert parse_body({"prompt": "a", "seed": -1}, chat=False).request.seed == 2**64 - 1
    with pytest.raises(ApiError):
        parse_body({"prompt": "a", "seed": -(2**63) - 1}, chat=False)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert parse_body({"messages": messages}, chat=True).request.messages == (
        ("system", "Be brief."),
        ("user", "Hello\nWorld"),
    )


def test_stream_options_need_stream():
    with pytest.raises(ApiError) as error:
        parse_body({"prompt": "a", "stream_options": {"include_usage": True}}, chat=False)
    assert error.value.param == "stream_options"


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
    # ... or the limit where that is lower: a request that asked for nothing is not refused.
    lower = dataclasses.replace(config, max_new_tokens_limit=5)
    assert prepare_job(grpc_request, lower, PAIR, tokenizer).max_new_tokens == 5


def test_a_max_tokens_past_the_context_is_refused_naming_what_fits():
    """vLLM and OpenAI answer 400 rather than cutting the answer short with finish_reason
    length; the gRPC API keeps cutting it short (its callers may generate to the context's end)."""
    config = CoordinatorConfig(draft_address="d:1", target_address="t:1", tokenizer="t")
    tokenizer = byte_level_tokenizer()
    left = PAIR.max_context - 3
    assert prepare_job(parse_body({"prompt": "abc", "max_tokens": left}, chat=False).request, config, PAIR, tokenizer)
    with pytest.raises(InvalidArgument) as refused:
        prepare_job(parse_body({"prompt": "abc", "max_tokens": left + 1}, chat=False).request, config, PAIR, tokenizer)
    error = api_error(refused.value)
    assert (error.status, error.param) == (400, "max_tokens") and f"at most {left}" in error.message
    assert "max_tokens=" in error.message
    # A chat client of OpenAI's newer API sends max_completion_tokens: the error names it.
    newer = parse_body({"prompt": "abc", "max_completion_tokens": left + 1}, chat=False)
    with pytest.raises(InvalidArgument) as refused:
        prepare_job(newer.request, config, PAIR, tokenizer)
    error = api_error(refused.value, newer.max_tokens_param)
    assert error.param == "max_completion_tokens" and "max_completion_tokens=" in error.message
    grpc_request = GenerationRequest(prompt="abc", max_new_tokens=left + 1)
    assert prepare_job(grpc_request, config, PAIR, tokenizer).max_new_tokens == left + 1


def test_tokens_per_round_counts_each_rounds_next_token_over_every_choice():
    """`speculation.tokens_per_round` is the stats' mean accepted length: accepted drafts plus
    the recovered or bonus token each round commits, over all the choices' rounds."""
    first, second = GenerationStats(), GenerationStats()
    first.record_round(4, 1)  # a draft accepted, then a recovered token: 2 tokens
    first.record_round(4, 0)  # 1 token
    second.record_round(2, 2)  # both accepted, then the bonus: 3 tokens
    figures = speculation(first, second)
    assert figures["tokens_per_round"] == 2.0 and figures["rounds"] == 3
    assert speculation(first)["tokens_per_round"] == first.mean_accepted_length == 1.5


@pytest.mark.parametrize(
    "body, param, said",
    [
        ({"prompt": "abc", "top_k": 2**31}, "top_k", "top_k must be in"),
        ({"prompt": "abc", "temperature": 1e39}, "temperature", "larger ones the wire's float32"),
        ({"prompt": [1, 10**20]}, "prompt", "past 64 bits"),
    ],
)
def test_a_value_the_wire_cannot_carry_is_the_clients_error_naming_it(body, param, said):
    """HTTP's JSON numbers are unbounded where the services' fields are int32 or float32:
    each was a 500 with a logged traceback (and top_k's held a session place for good)."""
    config = CoordinatorConfig(draft_address="d:1", target_address="t:1", tokenizer="t")
    with pytest.raises(InvalidArgument) as refused:
        prepare_job(parse_body(body, chat=False).request, config, PAIR, byte_level_tokenizer())
    error = api_error(refused.value)
    assert (error.status, error.param) == (400, param) and said in error.message


@pytest.mark.parametrize("field", ['"prompt": "a\\ud800b"', '"messages": [{"role": "user", "content": "\\udfff"}]'])
def test_an_escaped_lone_surrogate_is_a_bad_request(field):
    """JSON may escape half a UTF-16 pair; no text holds it, and the tokenizer raised a
    TypeError (a 500) on it. A pair escaped whole is text, and passes."""
    with pytest.raises(ApiError) as refused:
        parse_request_body(("{" + field + "}").encode(), chat="messages" in field, model_name="m")
    assert refused.value.status == 400 and "lone UTF-16 surrogate" in refused.value.message
    whole = parse_request_body(b'{"prompt": "\\ud83d\\ude00"}', chat=False, model_name="m")
    assert whole.request.prompt == "\U0001f600"
