"""Property-based fuzzing of the public API (hypothesis) against real in-process servers.

Every GenerateRequest field is drawn from valid values and from the edges: empty and huge
strings, arbitrary unicode and control characters, negative and huge integers, NaN, ±inf and
subnormal floats, huge repeated fields, unset optionals. Raw bytes (corrupt wire format,
strings that are not UTF-8) go through a generic channel call. Properties:

- a request the proto's documented rules accept succeeds, generates at most max_new_tokens and
  never shows a stop string;
- any other request fails with INVALID_ARGUMENT and a message naming an offending field, or
  RESOURCE_EXHAUSTED, unread, when it is larger than the largest request the model can take
  (coordinator.requests.request_limit_bytes);
- never INTERNAL, UNKNOWN, a hang or a crash: afterwards no session is left open and a
  normal request gives the target's greedy output.

Hypothesis runs on a worker thread and sends each call to the event loop the servers run on.
It is derandomized, so CI sees the same examples every run.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
import pytest_asyncio
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coordinator.pair import PairInfo
from coordinator.requests import (
    CHAT_ROLES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
    chat_prompt_ids,
    longest_token_bytes,
    request_limit_bytes,
)
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

# Valid requests left to the default stay short, so each example takes milliseconds.
DEFAULT_MAX_NEW_TOKENS = 8
# Example counts come from the profile (tests/conftest.py: 300 in `ci`, the default).
FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
CALL_TIMEOUT_S = 60  # a hang fails as DEADLINE_EXCEEDED, not by stalling CI
MALFORMED = "is not a valid specdec.v1.GenerateRequest"

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
INT32_EDGES = st.sampled_from([0, -1, 1, -(2**31), 2**31 - 1, 2**16, 10**9])
SMALLEST_SUBNORMAL = 1.401298464324817e-45  # float32
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
FLOAT32_EDGES = st.sampled_from(
    [
        0.0,
        -0.0,
        1.0,
        0.5,
        -1.0,
        math.nan,
        math.inf,
        -math.inf,
        SMALLEST_SUBNORMAL,
        1e-38,
        1.1754944e-38,
        MIN_TEMPERATURE,
        1e-6,
        3.4028235e38,
        1.0000001,
        0.99999994,
        2.0,
    ]
)
CONTROL_TEXT = st.text(st.characters(categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=20)


def chat_message(roles: st.SearchStrategy[str]) -> st.SearchStrategy[pb.ChatMessage]:
    content = st.one_of(st.text(max_size=40), CONTROL_TEXT)
    return st.builds(lambda role, text: pb.ChatMessage(role=role, content=text), roles, content)


def valid_requests(vocab_size: int) -> st.SearchStrategy[pb.GenerateRequest]:
    """Requests the documented rules accept, at the edges of what they accept."""
    prompt = st.one_of(
        st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=60), CONTROL_TEXT)}),
        st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=120)}),
        st.fixed_dictionaries(
            {"messages": st.lists(chat_message(st.sampled_from(CHAT_ROLES)), min_size=1, max_size=4)}
        ),
    )
    stop_string = st.one_of(st.text(min_size=1, max_size=4), CONTROL_TEXT, st.text(min_size=250, max_size=256))
    optional = {
        "max_new_tokens": st.integers(1, DEFAULT_MAX_NEW_TOKENS),
        "temperature": st.one_of(
            st.just(0.0),
            st.sampled_from([MIN_TEMPERATURE, 3.4028235e38]),
            st.floats(MIN_TEMPERATURE, 2.0**100, width=32),
        ),
        "top_k": st.one_of(st.integers(0, 20), st.integers(0, 2**31 - 1)),
        "top_p": st.one_of(
            st.sampled_from([SMALLEST_SUBNORMAL, 1.0, 0.99999994]), st.floats(SMALLEST_SUBNORMAL, 1.0, width=32)
        ),
        "seed": st.one_of(st.sampled_from([0, 2**63, 2**64 - 1]), UINT64),
        "stop": st.lists(stop_string, max_size=16),
        "num_speculative_tokens": st.integers(0, 8),
    }
    return st.builds(
        lambda prompt, rest: pb.GenerateRequest(**prompt, **rest), prompt, st.fixed_dictionaries({}, optional=optional)
    )


def any_requests(vocab_size: int, huge_fields: bool = True) -> st.SearchStrategy[pb.GenerateRequest]:
    """Requests with every field anywhere in its wire type's range, huge ones included."""

    def huge(piece: st.SearchStrategy, max_times: int) -> st.SearchStrategy:
        """`piece` repeated up to `max_times` times: large values hypothesis would never build itself."""
        if not huge_fields:
            return st.nothing()
        return st.tuples(piece, st.integers(1, max_times)).map(lambda pair: pair[0] * pair[1])

    text = st.one_of(st.text(max_size=60), CONTROL_TEXT, huge(st.text(min_size=1, max_size=8), 200_000))
    token_ids = st.one_of(
        st.lists(st.one_of(INT32, INT32_EDGES, st.integers(vocab_size - 2, vocab_size + 2)), max_size=60),
        huge(st.lists(st.one_of(st.integers(0, vocab_size - 1), INT32), min_size=1, max_size=3), 300_000),
    )
    roles = st.one_of(st.sampled_from(CHAT_ROLES), st.text(max_size=12))
    messages = st.one_of(
        st.lists(chat_message(roles), max_size=4), huge(st.lists(chat_message(roles), min_size=1, max_size=2), 20_000)
    )
    prompt = st.one_of(
        st.fixed_dictionaries({"prompt": text}),
        st.fixed_dictionaries({"prompt_token_ids": token_ids}),
        st.fixed_dictionaries({"messages": messages}),
        st.fixed_dictionaries({"prompt": text, "prompt_token_ids": token_ids}),
        st.fixed_dictionaries({"prompt": text, "messages": messages}),
        st.just({}),
    )
    # Valid max_new_tokens above 8 are skipped: valid requests stay fast.
    max_new_tokens = st.one_of(INT32_EDGES, INT32.filter(lambda n: not DEFAULT_MAX_NEW_TOKENS < n <= 2048))
    stop_string = st.one_of(st.text(max_size=4), st.just(""), huge(st.text(min_size=1, max_size=4), 100_000))
    stop = st.one_of(
        st.lists(stop_string, max_size=20), huge(st.lists(st.text(max_size=3), min_size=1, max_size=2), 50_000)
    )
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": st.one_of(FLOAT32_EDGES, FLOAT32),
        "top_k": st.one_of(INT32_EDGES, INT32),
        "top_p": st.one_of(FLOAT32_EDGES, FLOAT32),
        "seed": UINT64,
        "stop": stop,
        "num_speculative_tokens": st.one_of(INT32_EDGES, INT32),
    }
    return st.builds(
        lambda prompt, rest: pb.GenerateRequest(**prompt, **rest), prompt, st.fixed_dictionaries({}, optional=optional)
    )


def requests(vocab_size: int, huge_fields: bool = True) -> st.SearchStrategy[pb.GenerateRequest]:
    """About half valid (so generation itself meets odd values), half anywhere."""
    return st.one_of(valid_requests(vocab_size), any_requests(vocab_size, huge_fields))


@dataclass(frozen=True)
class Limits:
    """What the running stack accepts, from its config and both services' Info."""

    vocab_size: int
    max_context: int
    max_num_speculative_tokens: int
    max_new_tokens_limit: int
    max_stop_strings: int
    max_stop_string_chars: int
    tokenizer: PreTrainedTokenizerBase
    request_bytes: int  # the largest request the coordinator reads (coordinator.requests.request_limit_bytes)

    def prompt_length(self, request: pb.GenerateRequest) -> int:
        if request.messages:
            return len(chat_prompt_ids(tuple((m.role, m.content) for m in request.messages), self.tokenizer))
        return len(request.prompt_token_ids) or len(
            self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        )


def problems(request: pb.GenerateRequest, limits: Limits) -> list[str]:
    """Fields the proto's documented rules (with the server's limits) reject; empty = valid.
    Read back from the message, so floats are the float32 values the server sees."""
    found = []
    if sum(map(bool, (request.prompt, request.prompt_token_ids, request.messages))) != 1:
        found.append("prompt")
    elif any(m.role not in CHAT_ROLES for m in request.messages):
        found.append("messages")
    elif len(request.prompt_token_ids) >= limits.max_context:  # the length, before any id is read
        found.append("prompt")
    elif request.prompt_token_ids and not all(0 <= t < limits.vocab_size for t in request.prompt_token_ids):
        found.append("prompt_token_ids")
    elif not 0 < limits.prompt_length(request) < limits.max_context:
        found.append("prompt")
    if request.HasField("max_new_tokens") and not 1 <= request.max_new_tokens <= limits.max_new_tokens_limit:
        found.append("max_new_tokens")
    temperature = request.temperature
    if not (math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        found.append("temperature")
    if request.top_k < 0:
        found.append("top_k")
    if request.HasField("top_p") and not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
        found.append("top_p")
    if (
        request.HasField("num_speculative_tokens")
        and not 0 <= request.num_speculative_tokens <= limits.max_num_speculative_tokens
    ):
        found.append("num_speculative_tokens")
    if len(request.stop) > limits.max_stop_strings or not all(
        0 < len(s) <= limits.max_stop_string_chars for s in request.stop
    ):
        found.append("stop")
    return found


async def call(
    stack, request: pb.GenerateRequest | bytes, streamed: bool
) -> tuple[pb.GenerateResponse | None, grpc.aio.AioRpcError | None]:
    """One Generate or GenerateStream call (a stream folded into one response); a typed request
    goes through the stub, raw bytes through a generic call with identity serializers."""
    if isinstance(request, bytes):
        method = stack.channel.unary_stream if streamed else stack.channel.unary_unary
        path = "/specdec.v1.Coordinator/GenerateStream" if streamed else "/specdec.v1.Coordinator/Generate"
        rpc = method(path, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
    else:
        rpc = stack.stub.GenerateStream if streamed else stack.stub.Generate
    try:
        if not streamed:
            return await rpc(request, timeout=CALL_TIMEOUT_S), None
        chunks = [chunk async for chunk in rpc(request, timeout=CALL_TIMEOUT_S)]
    except grpc.aio.AioRpcError as error:
        return None, error
    assert chunks and chunks[-1].finish_reason and all(not c.finish_reason for c in chunks[:-1])
    return pb.GenerateResponse(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=chunks[-1].finish_reason,
        stats=chunks[-1].stats,
    ), None


def check_outcome(request: pb.GenerateRequest, size: int, limits: Limits, response, error) -> None:
    """The properties of one call, given the request as the server parsed it and its wire size."""
    if size > limits.request_bytes:
        assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (size, error)
        assert "larger than max" in error.details()
        return
    found = problems(request, limits)
    if error is not None:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"{error.code()}: {error.details()} for {found or 'a valid request'}"
        )
        assert found, f"a valid request was refused: {error.details()}"
        assert any(name in error.details() for name in found), f"{error.details()!r} names none of {found}"
        return
    assert not found, f"accepted although {found} should have been refused"
    limit = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    generated = len(response.token_ids)
    assert generated <= limit and response.stats.generated_tokens == generated
    assert response.finish_reason in ("length", "eos", "stop")
    if response.finish_reason == "length":  # the limit, or the end of the model's context
        assert generated == limit or response.stats.prompt_tokens + generated >= limits.max_context
    assert not any(s in response.text for s in request.stop), "a stop string reached the output"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    overrides = dict(default_max_new_tokens=DEFAULT_MAX_NEW_TOKENS, http_port=0)
    async with inprocess_stack(tiny_pair, coordinator_overrides=overrides) as running:
        yield running


@pytest.fixture(scope="module")
def limits(stack, tiny_pair) -> Limits:
    draft, target, config = stack.draft_runner.describe(), stack.target_runner.describe(), stack.coordinator_config
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    pair = PairInfo(target.vocab_size, draft.vocab_size, frozenset(), target.max_context, draft.max_context, 0)
    return Limits(
        vocab_size=min(draft.vocab_size, target.vocab_size),
        max_context=target.max_context,
        max_num_speculative_tokens=min(draft.max_speculative_tokens, target.max_speculative_tokens),
        max_new_tokens_limit=config.max_new_tokens_limit,
        max_stop_strings=MAX_STOP_STRINGS,
        max_stop_string_chars=MAX_STOP_STRING_CHARS,
        tokenizer=tokenizer,
        request_bytes=request_limit_bytes(config, pair, longest_token_bytes(tokenizer)),
    )


async def fuzz_from_thread(check) -> None:
    """Runs the sync hypothesis test `check(submit)` on a worker thread; `submit(coro)` runs a
    coroutine on this loop, where the servers and the channel live, and returns its result."""
    loop = asyncio.get_running_loop()

    def submit(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=2 * CALL_TIMEOUT_S)

    await asyncio.to_thread(check, submit)


async def wait_sessions_closed(stack) -> None:
    for _ in range(100):
        if len(stack.draft_runner.sessions) == 0 and len(stack.target_runner.sessions) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(
        f"sessions left open: draft {len(stack.draft_runner.sessions)}, target {len(stack.target_runner.sessions)}"
    )


async def test_every_request_field_is_served_or_invalid_argument(stack, limits):
    def check(submit) -> None:
        @FUZZ_SETTINGS
        @given(request=requests(limits.vocab_size), streamed=st.booleans())
        # Regressions: a positive temperature this small made logits / temperature overflow to
        # inf, the draft sent NaN distributions and the client got INTERNAL.
        @example(request=pb.GenerateRequest(prompt="hi", temperature=1e-38, num_speculative_tokens=4), streamed=False)
        @example(request=pb.GenerateRequest(prompt="hi", temperature=1e-45, num_speculative_tokens=0), streamed=True)
        @example(request=pb.GenerateRequest(prompt="a" * 1_000_000), streamed=False)
        @example(request=pb.GenerateRequest(prompt_token_ids=[2**31 - 1] * 300_000), streamed=True)
        @example(request=pb.GenerateRequest(prompt="hi", stop=["x" * 257]), streamed=False)
        def fuzz(request: pb.GenerateRequest, streamed: bool) -> None:
            response, error = submit(call(stack, request, streamed))
            check_outcome(request, request.ByteSize(), limits, response, error)

        fuzz()

    await fuzz_from_thread(check)
    await wait_sessions_closed(stack)


def varint(value: int) -> bytes:
    """Protobuf base-128 varint."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def mutated_requests(draw, vocab_size: int) -> bytes:
    """A request's bytes, cut short, with a byte flipped, with bytes inserted or with an unknown field."""
    serialized = draw(requests(vocab_size, huge_fields=False)).SerializeToString()
    how = draw(st.sampled_from(["truncate", "flip", "insert", "unknown field"]))
    if how == "unknown field":  # proto3 keeps and ignores it: the request means the same
        field_number = draw(st.integers(10, 2**29 - 1))
        return serialized + varint(field_number << 3) + varint(draw(st.integers(0, 2**64 - 1)))
    if not serialized or how == "insert":
        at = draw(st.integers(0, len(serialized)))
        return serialized[:at] + draw(st.binary(min_size=1, max_size=8)) + serialized[at:]
    at = draw(st.integers(0, len(serialized) - 1))
    if how == "truncate":
        return serialized[:at]
    return serialized[:at] + bytes([serialized[at] ^ draw(st.integers(1, 255))]) + serialized[at + 1 :]


async def test_raw_bytes_are_parsed_or_invalid_argument(stack, limits):
    """Bytes that do not parse as a GenerateRequest get INVALID_ARGUMENT (grpc.aio's own answer
    would be UNKNOWN); bytes that do parse obey the typed properties above."""

    def check(submit) -> None:
        @FUZZ_SETTINGS
        @given(raw=st.one_of(st.binary(max_size=64), mutated_requests(limits.vocab_size)), streamed=st.booleans())
        @example(raw=b"\x0a\x02\xc3\x28", streamed=False)  # regression: prompt not UTF-8 gave UNKNOWN
        @example(raw=b"\xff\xff\xff\xff", streamed=True)  # regression: corrupt wire format gave UNKNOWN
        def fuzz(raw: bytes, streamed: bool) -> None:
            response, error = submit(call(stack, raw, streamed))
            try:
                request = pb.GenerateRequest.FromString(raw)
            except DecodeError:
                assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
                assert MALFORMED in error.details() and "UTF-8" in error.details()
                return
            check_outcome(request, len(raw), limits, response, error)

        fuzz()

    await fuzz_from_thread(check)
    await wait_sessions_closed(stack)


async def test_request_size_limit_is_exact_and_resource_exhausted(stack, limits):
    """A request of exactly the largest size a valid request can have reaches validation; one
    byte more is refused by gRPC itself, unread, with RESOURCE_EXHAUSTED naming both sizes."""
    limit = limits.request_bytes
    at_limit = pb.GenerateRequest(prompt="a" * (limit - 1 - (limit.bit_length() + 6) // 7))  # tag, length, text
    over = pb.GenerateRequest(prompt=at_limit.prompt + "a")
    assert (at_limit.ByteSize(), over.ByteSize()) == (limit, limit + 1)
    for streamed in (False, True):
        _, error = await call(stack, at_limit, streamed)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "context is" in error.details()
        _, error = await call(stack, over, streamed)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.search(rf"larger than max \({limit + 1} vs\. {limit}\)", error.details()), error.details()


# --- the OpenAI-compatible HTTP API ---------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), INT32, INT32_EDGES, st.floats(allow_nan=False), FLOAT32_EDGES.filter(math.isfinite),
    st.text(max_size=20), CONTROL_TEXT,
)  # fmt: skip
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
HTTP_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stream", "stream_options", "n", "logprobs", "presence_penalty", "num_speculative_tokens",
    "draft_min_confidence", "user",
]  # fmt: skip


@st.composite
def http_bodies(draw, chat: bool) -> bytes:
    """Request bodies: about half valid OpenAI requests (so generation meets odd values too),
    the rest with one field anywhere in JSON, an unknown field, another JSON value, or bytes
    that are not JSON."""
    text = st.one_of(st.text(min_size=1, max_size=30), CONTROL_TEXT)
    message = st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": st.text(max_size=30)})
    body = (
        {"messages": draw(st.lists(message, min_size=1, max_size=3))}
        if chat
        else {"prompt": draw(st.one_of(text, st.lists(st.integers(0, 319), min_size=1, max_size=8)))}
    )
    optional = {
        "max_tokens": st.integers(1, DEFAULT_MAX_NEW_TOKENS),
        "temperature": st.one_of(st.just(0), st.floats(0, 2)),
        "top_p": st.floats(0.01, 1),
        "stream": st.booleans(),
        "seed": st.integers(0, 2**63),
        "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
        "num_speculative_tokens": st.integers(0, 8),
        "n": st.just(1),
    }
    body.update(draw(st.fixed_dictionaries({}, optional=optional)))
    body.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)  # OpenAI's default is longer: keep examples fast
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.binary(max_size=40))
    if choice == 1:
        return json.dumps(draw(JSON)).encode()
    if choice in (2, 3, 4):
        body[draw(st.sampled_from(HTTP_FIELDS))] = draw(JSON)
    if choice == 5:
        body[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
    return json.dumps(body).encode()


async def post(stack, path: str, body: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{stack.coordinator.http_port}/v1/{path}",
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
        ) as response:
            return response.status, await response.read()


async def test_http_bodies_are_served_or_a_400_that_says_why(stack):
    """Never a 500: a body is served (200), refused with OpenAI's error body and a message
    (400; 404 for another model's name), and the service serves on afterwards."""

    def check(submit) -> None:
        @FUZZ_SETTINGS
        @given(data=st.data(), chat=st.booleans())
        def fuzz(data, chat: bool) -> None:
            body = data.draw(http_bodies(chat))
            status, reply = submit(post(stack, "chat/completions" if chat else "completions", body))
            event(f"HTTP {status}")  # --hypothesis-show-statistics: how often each answer was seen
            assert status in (200, 400, 404), (status, body, reply[:300])
            if status == 200:
                if reply.startswith(b"data: "):  # a stream: events, then [DONE] (or an error event)
                    assert reply.rstrip().endswith(b"data: [DONE]"), reply[-200:]
                else:
                    assert json.loads(reply)["choices"]
                return
            error = json.loads(reply)["error"]
            assert error["message"] and error["type"], error

        fuzz()

    await fuzz_from_thread(check)
    await wait_sessions_closed(stack)


async def test_after_the_fuzz_a_normal_request_gives_the_target_greedy_output(stack, reference):
    """Runs last in this module: whatever the fuzz sent, the stack still serves exact output."""
    prompt = "def add(a, b):"
    expected = reference(prompt, 16)
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=16, num_speculative_tokens=4)
    for streamed in (False, True):
        response, error = await call(stack, request, streamed)
        assert error is None and list(response.token_ids) == expected
    await wait_sessions_closed(stack)
