"""The public request shape: what README's grpcurl line sends must parse, with unset = default."""

from __future__ import annotations

from google.protobuf import json_format

from coordinator.servicer import request_from_pb
from specdec.v1 import coordinator_pb2


def test_grpcurl_json_request_parses_with_defaults():
    request = json_format.Parse('{"prompt": "def fib(n):", "max_new_tokens": 32}', coordinator_pb2.GenerateRequest())
    domain = request_from_pb(request)
    assert domain.prompt == "def fib(n):" and domain.max_new_tokens == 32
    assert domain.top_p is None and domain.seed is None and domain.num_speculative_tokens is None
    assert domain.temperature == 0.0 and domain.top_k == 0


def test_explicit_zero_is_distinguished_from_unset():
    request = json_format.Parse(
        '{"prompt_token_ids": [1, 2], "num_speculative_tokens": 0, "seed": "0", "top_p": 0.5, "stop": ["\\n"]}',
        coordinator_pb2.GenerateRequest(),
    )
    domain = request_from_pb(request)
    assert domain.num_speculative_tokens == 0 and domain.seed == 0 and domain.top_p == 0.5
    assert list(domain.prompt_token_ids) == [1, 2] and list(domain.stop) == ["\n"] and domain.max_new_tokens is None
