"""The KV byte budget: least recently used sessions are evicted to make room, a session that
cannot fit alone is refused with the numbers, and Info reports the memory."""

from __future__ import annotations

import pytest
import torch

from specdec.config.services import parse_bytes
from specdec.engine.modeling import load_causal_lm
from specdec.errors import ResourceExhausted, SessionNotFound
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    return load_causal_lm(str(tiny_pair.target), "float32", "cpu")


def verify(runner, session_id, keep, new_tokens):
    return runner.verify_one(
        VerifyCall(session_id, keep, new_tokens, [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0)
    )


def test_bytes_per_token_is_what_the_cache_really_holds(loaded):
    runner = TargetRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    verify(runner, "m", 0, list(range(1, 31)))
    session = runner.sessions.open("m", 1)
    assert session.kv_bytes == session.cached_tokens * runner.kv_bytes_per_token > 0
    info = runner.describe()
    assert (info.kv_cache_bytes, info.kv_bytes_per_token, info.max_kv_cache_bytes) == (
        session.kv_bytes,
        runner.kv_bytes_per_token,
        0,
    )


def test_least_recently_used_sessions_are_evicted_to_fit_the_budget(loaded):
    per_token = TargetRunner(loaded, 1, 60, 4).kv_bytes_per_token
    runner = TargetRunner(
        loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=70 * per_token
    )
    verify(runner, "old", 0, list(range(1, 31)))  # 30 tokens
    verify(runner, "recent", 0, list(range(1, 31)))  # 60 in all
    verify(runner, "recent", 30, [5])  # "recent" is now the most recently used
    verify(runner, "new", 0, list(range(1, 21)))  # 81 > 70: the least recently used goes
    assert runner.sessions.evicted == 1
    with pytest.raises(SessionNotFound):
        verify(runner, "old", 30, [5])
    verify(runner, "recent", 31, [6])  # still held
    info = runner.describe()
    assert info.kv_cache_bytes <= info.max_kv_cache_bytes == 70 * per_token and info.evicted_sessions == 1


def test_a_session_that_cannot_fit_alone_is_refused_with_the_numbers(loaded):
    per_token = TargetRunner(loaded, 1, 60, 4).kv_bytes_per_token
    runner = TargetRunner(
        loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=10 * per_token
    )
    verify(runner, "other", 0, [1, 2, 3])
    with pytest.raises(ResourceExhausted) as refused:
        verify(runner, "big", 0, list(range(1, 21)))
    message = str(refused.value)
    assert f"{20 * per_token} bytes" in message and "(20 tokens" in message and f"is {10 * per_token} bytes" in message
    assert "--max-kv-bytes" in message
    assert runner.sessions.evicted == 0, "a request that cannot fit must not evict others for nothing"
    with pytest.raises(SessionNotFound):
        verify(runner, "big", 20, [5])  # nothing half-made is kept
    verify(runner, "other", 3, [4])  # the service keeps serving


def test_sizes_parse_with_units():
    assert parse_bytes("1048576") == 2**20
    assert (
        parse_bytes("512MiB") == 512 * 2**20
        and parse_bytes("8GiB") == 8 * 2**30
        and parse_bytes("1.5GB") == 1_500_000_000
    )
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
