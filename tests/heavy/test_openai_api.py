"""The OpenAI-compatible HTTP API, driven by the official `openai` client.

Against real processes (draft, target and a coordinator serving HTTP with bearer tokens,
exporting traces to a stand-in for Jaeger): chat and completions, streamed and not, stop,
seed and max_tokens, greedy output identical to the gRPC API's, 400s with clear messages,
401 for a missing or wrong token, one trace from an HTTP `traceparent` to the draft and target,
and the metrics counting HTTP requests. In process: a dead target gives 503, and the body
parser refuses what it does not serve by name.
"""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.request
from contextlib import ExitStack

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.openai_schema import api_error, parse_body
from specdec.config.services import ClientSecurity, ServerSecurity
from specdec.errors import InvalidArgument, ResourceExhausted, Unavailable
from specdec.rpc.ports import free_port
from specdec.rpc.security import read_tokens
from specdec.tools.launch import local_stack
from specdec.tools.loadgen import Load, run_load, summarise
from specdec.v1 import common_pb2, coordinator_pb2_grpc, draft_pb2_grpc, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.otlp_receiver import OtlpTraceReceiver
from tests.stack import inprocess_stack

TOKEN = "test-token-0123"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    """The three services as processes; the coordinator serves HTTP and gRPC behind a token
    and exports traces to an OTLP receiver."""
    folder = tmp_path_factory.mktemp("openai")
    tokens = folder / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    receiver = OtlpTraceReceiver()
    endpoint = receiver.start()
    http_port, metrics_port = free_port(), free_port()
    with ExitStack() as stack, pytest.MonkeyPatch.context() as env:
        stack.callback(receiver.stop)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        services = stack.enter_context(
            local_stack(
                tiny_pair.draft,
                tiny_pair.target,
                folder,
                threads=1,
                coordinator_args=[
                    *("--http-port", str(http_port), "--metrics-port", str(metrics_port)),
                    *("--auth-token-file", str(tokens), "--served-model-name", "tiny-coder"),
                ],
            )
        )
        channel = stack.enter_context(grpc.insecure_channel(services["coordinator"].address))
        draft = stack.enter_context(grpc.insecure_channel(services["draft"].address))
        target = stack.enter_context(grpc.insecure_channel(services["target"].address))
        yield {
            "info": {"draft": draft_pb2_grpc.DraftStub(draft).Info, "target": target_pb2_grpc.TargetStub(target).Info},
            "base_url": f"http://127.0.0.1:{http_port}/v1",
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "grpc": coordinator_pb2_grpc.CoordinatorStub(channel),
            "receiver": receiver,
        }


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base_url"], api_key=TOKEN, max_retries=0, timeout=60)


def grpc_generate(served, **fields) -> pb.GenerateResponse:
    if "messages" in fields:
        fields["messages"] = [pb.ChatMessage(**message) for message in fields["messages"]]
    return served["grpc"].Generate(
        pb.GenerateRequest(**fields), timeout=60, metadata=(("authorization", f"Bearer {TOKEN}"),)
    )


def test_models_lists_the_served_name(client):
    assert [model.id for model in client.models.list().data] == ["tiny-coder"]


def test_http_health_is_ok_while_the_coordinator_serves(served):
    base = served["base_url"].removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/health", timeout=10) as response:  # no token: probes carry none
        assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})


def test_chat_greedy_equals_the_grpc_chat_streamed_or_not(served, client):
    expected = grpc_generate(served, messages=CHAT, max_new_tokens=16, temperature=0)
    reply = client.chat.completions.create(model="tiny-coder", messages=CHAT, max_tokens=16, temperature=0)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[expected.finish_reason]
    assert reply.usage.completion_tokens == len(expected.token_ids) == expected.stats.generated_tokens
    assert reply.usage.prompt_tokens > 0 and reply.usage.total_tokens == reply.usage.prompt_tokens + len(
        expected.token_ids
    )
    figures = reply.model_extra["speculation"]
    assert figures["rounds"] > 0 and 0 <= figures["acceptance_rate"] <= 1 and figures["tokens_per_round"] >= 1

    chunks = list(
        client.chat.completions.create(
            model="tiny-coder",
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and not chunks[-1].choices


def test_completions_greedy_equal_the_grpc_prompt_streamed_or_not(served, client):
    expected = grpc_generate(served, prompt="def add(a, b):", max_new_tokens=20, temperature=0)
    reply = client.completions.create(model="tiny-coder", prompt="def add(a, b):", max_tokens=20, temperature=0)
    assert reply.choices[0].text == expected.text and reply.usage.completion_tokens == len(expected.token_ids)
    streamed = list(
        client.completions.create(
            model="tiny-coder", prompt="def add(a, b):", max_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    # A request's own K (an extra field) is honoured: K = 0 gives the same text, no drafts.
    alone = client.completions.create(
        model="tiny-coder",
        prompt="def add(a, b):",
        max_tokens=20,
        temperature=0,
        extra_body={"num_speculative_tokens": 0},
    )
    assert alone.choices[0].text == expected.text and alone.model_extra["speculation"]["proposed_tokens"] == 0
    # ... and so is a token tree.
    tree = client.completions.create(
        model="tiny-coder",
        prompt="def add(a, b):",
        max_tokens=20,
        temperature=0,
        extra_body={"tree_widths": [2, 1]},
    )
    assert tree.choices[0].text == expected.text and tree.model_extra["speculation"]["proposed_tokens"] > 0


def test_logprobs_are_the_grpc_apis_in_each_endpoints_shape(served, client):
    """Chat's logprobs.content and a completion's legacy logprobs carry the same figures as
    the gRPC API's GenerateResponse.logprobs, one per token, streamed or not."""
    expected = grpc_generate(served, messages=CHAT, max_new_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(
        model="tiny-coder", messages=CHAT, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in expected.logprobs])
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob for entry in content)  # greedy: the likeliest
    assert len(content) == reply.usage.completion_tokens
    streamed = list(
        client.chat.completions.create(
            model="tiny-coder", messages=CHAT, max_tokens=16, temperature=0, logprobs=True, stream=True
        )
    )
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [entry.logprob for entry in entries] == pytest.approx([e.logprob for e in expected.logprobs])
    assert client.chat.completions.create(model="tiny-coder", messages=CHAT, max_tokens=4).choices[0].logprobs is None

    completion = client.completions.create(model="tiny-coder", prompt="x", max_tokens=8, temperature=0, logprobs=3)
    expected = grpc_generate(served, prompt="x", max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    legacy = completion.choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs])
    assert len(legacy.tokens) == len(legacy.text_offset) == len(expected.token_ids)
    assert all(len(top) <= 3 for top in legacy.top_logprobs)  # tokens rendering alike may merge


def test_logit_bias_reaches_the_target_as_through_grpc(served, client):
    plain = grpc_generate(served, prompt="def add(a, b):", max_new_tokens=8, temperature=0)
    banned = {plain.token_ids[0]: -100.0}
    expected = grpc_generate(served, prompt="def add(a, b):", max_new_tokens=8, temperature=0, logit_bias=banned)
    assert expected.token_ids[0] != plain.token_ids[0]
    reply = client.completions.create(
        model="tiny-coder",
        prompt="def add(a, b):",
        max_tokens=8,
        temperature=0,
        logit_bias={str(token): value for token, value in banned.items()},
    )
    assert reply.choices[0].text == expected.text


def test_n_choices_are_generations_with_seeds_in_turn_streamed_or_not(served, client):
    """n > 1: each choice is a request of its own, choice i drawn with seed + i, so choice 0 is
    the n = 1 output and each is reproducible; usage counts every choice's tokens."""
    request = dict(model="tiny-coder", messages=CHAT, max_tokens=12, temperature=0.9)
    reply = client.chat.completions.create(**request, n=3, seed=11)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**request, seed=11 + i) for i in range(3)]
    assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.model_extra["speculation"]["rounds"] == sum(a.model_extra["speculation"]["rounds"] for a in alone)
    streamed = list(
        client.chat.completions.create(**request, n=3, seed=11, stream=True, stream_options={"include_usage": True})
    )
    texts = ["", "", ""]
    finishes = [0, 0, 0]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == [c.message.content for c in reply.choices] and finishes == [1, 1, 1]
    assert streamed[-1].usage.completion_tokens == reply.usage.completion_tokens
    completions = client.completions.create(model="tiny-coder", prompt="x", max_tokens=6, temperature=0, n=2)
    assert completions.choices[0].text == completions.choices[1].text  # greedy: the same twice


def test_stop_seed_and_max_tokens(served, client):
    request = dict(model="tiny-coder", messages=CHAT, max_tokens=24, temperature=0.9, seed=7)
    first = client.chat.completions.create(**request)
    again = client.chat.completions.create(**request)
    assert first.choices[0].message.content == again.choices[0].message.content, "the same seed, the same output"
    expected = grpc_generate(served, messages=CHAT, max_new_tokens=24, temperature=0.9, seed=7)
    assert first.choices[0].message.content == expected.text, "the HTTP and gRPC APIs sample the same way"
    text = first.choices[0].message.content
    assert len(text) > 6
    stop = text[3:6]
    stopped = client.chat.completions.create(**request, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    short = client.completions.create(model="tiny-coder", prompt="x", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3
    assert short.choices[0].finish_reason in ("length", "stop")


def test_an_unset_max_tokens_runs_to_the_end_of_the_context_and_unknown_fields_are_named(served, client):
    """As vLLM's server: no max_tokens is the rest of the model's context (here within the
    server's --max-new-tokens-limit, 2048), and a field the server does not know is left out,
    named in the X-Specdec-Ignored-Fields header."""
    raw = client.completions.with_raw_response.create(
        model="tiny-coder", prompt="def add(a, b):", temperature=0, extra_body={"frobnicate": 1}
    )
    reply = raw.parse()
    assert raw.headers["X-Specdec-Ignored-Fields"] == "frobnicate"
    context = served["info"]["target"](common_pb2.InfoRequest(), timeout=10).max_context
    rest = context - reply.usage.prompt_tokens
    expected = grpc_generate(served, prompt="def add(a, b):", max_new_tokens=rest)
    assert reply.choices[0].text == expected.text and reply.usage.completion_tokens == len(expected.token_ids)
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == rest
    plain = client.completions.with_raw_response.create(model="tiny-coder", prompt="x", max_tokens=2)
    assert "X-Specdec-Ignored-Fields" not in plain.headers


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1}, r"temperature must be"),
        ({"n": 17}, r"n must be in \[1, 16\]"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"role is 'robot'"),
        ({"max_tokens": 0}, r"max_tokens must be in \[1"),
        ({"max_completion_tokens": 0}, r"max_completion_tokens must be in \[1"),
        ({"top_logprobs": 2}, r"top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]"),
        ({"extra_body": {"cache_salt": 5}}, r"cache_salt must be a string"),
    ],
)
def test_bad_input_is_a_400_that_says_why(client, fields, message):
    request = {"model": "tiny-coder", "messages": CHAT, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**request)
    assert error.value.status_code == 400 and re.search(message, error.value.message), error.value.message
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_a_missing_or_wrong_token_is_a_401(served):
    wrong = openai.OpenAI(base_url=served["base_url"], api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid bearer token"):
        wrong.chat.completions.create(model="tiny-coder", messages=CHAT)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(served["base_url"] + "/models", timeout=10)
    assert error.value.code == 401
    assert json.loads(error.value.read())["error"]["type"] == "authentication_error"


def test_a_client_that_disconnects_mid_stream_frees_both_sessions_within_a_second(served):
    def open_sessions() -> dict[str, int]:
        return {name: info(common_pb2.InfoRequest(), timeout=5).open_sessions for name, info in served["info"].items()}

    # No max_tokens: the rest of the context (one past it is a 400), a stream long enough to leave.
    body = {"messages": CHAT, "temperature": 0, "stream": True, "num_speculative_tokens": 1}
    request = urllib.request.Request(
        served["base_url"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # the stream is under way
    assert open_sessions() == {"draft": 1, "target": 1}
    response.close()  # the client goes away mid-stream
    closed = time.monotonic()
    while (sessions := open_sessions()) != {"draft": 0, "target": 0}:
        assert time.monotonic() - closed < 1.0, f"sessions still open a second after the client left: {sessions}"
        time.sleep(0.02)


def test_an_http_request_is_one_trace_with_the_draft_and_target(served):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request = urllib.request.Request(
        served["base_url"] + "/chat/completions",
        data=json.dumps({"messages": CHAT, "max_tokens": 8, "temperature": 0}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {TOKEN}",
            "traceparent": f"00-{trace_id}-{parent}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        rounds = json.loads(response.read())["speculation"]["rounds"]

    def complete(spans) -> bool:
        names = [s.name for s in spans]
        return (
            {s.service for s in spans} == {"specdec-coordinator", "specdec-draft", "specdec-target"}
            and "POST /v1/chat/completions" in names
            and names.count("target.verify") == rounds
        )

    spans = served["receiver"].wait_for(trace_id, complete)
    (http,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert http.parent_span_id == parent, "the HTTP span continues the caller's traceparent"
    assert all(s.name != "round" or s.parent_span_id == http.span_id for s in spans)


def test_metrics_count_http_requests_like_grpc_ones(served, client):
    def scrape() -> dict:
        with urllib.request.urlopen(served["metrics"], timeout=10) as response:
            text = response.read().decode()
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return found

    before = scrape()
    client.chat.completions.create(model="tiny-coder", messages=CHAT, max_tokens=4, temperature=0)
    after = scrape()
    http = ("specdec_http_requests_total", (("path", "/v1/chat/completions"), ("status", "200")))
    assert after[http] - before.get(http, 0) == 1
    finished = [key for key in after if key[0] == "specdec_requests_total"]
    assert sum(after[key] - before.get(key, 0) for key in finished) == 1


async def test_an_unavailable_target_is_a_503(tiny_pair):
    async with inprocess_stack(
        tiny_pair, coordinator_overrides={"http_port": 0, "connect_timeout_s": 0.5, "target_timeout_s": 5}
    ) as stack:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{stack.coordinator.http_port}/v1", api_key="unused", max_retries=0
        )
        model = (await client.models.list()).data[0].id
        await client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
        await stack.target.stop(0)
        with pytest.raises(openai.APIStatusError) as error:
            await client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
        assert error.value.status_code == 503 and "target" in error.value.message


async def test_https_with_a_client_certificate_and_tokens_as_for_grpc(tiny_pair, tls_files):
    """The HTTP API takes the gRPC API's TLS files and tokens: HTTPS with the same certificate,
    client certificates required by --tls-client-ca, bearer tokens from --auth-token-file."""
    security = ServerSecurity(tls_files.server_cert, tls_files.server_key, tls_files.ca, tls_files.tokens)
    client_security = ClientSecurity(tls_files.ca, tls_files.client_cert, tls_files.client_key, None, tls_files.tokens)
    async with inprocess_stack(
        tiny_pair, coordinator_overrides={"http_port": 0, "security": security}, client_security=client_security
    ) as stack:
        base_url = f"https://127.0.0.1:{stack.coordinator.http_port}/v1"
        token = read_tokens(tls_files.tokens, "tokens")[0]
        trusted = openai.DefaultAsyncHttpxClient(
            verify=ssl_context(tls_files.ca, tls_files.client_cert, tls_files.client_key)
        )
        client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, http_client=trusted)
        model = (await client.models.list()).data[0].id
        reply = await client.completions.create(model=model, prompt="x", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens >= 1
        wrong = openai.AsyncOpenAI(base_url=base_url, api_key="nope", max_retries=0, http_client=trusted)
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model=model, prompt="x", max_tokens=2)
        # No client certificate: the TLS handshake is refused, as for gRPC.
        anonymous = openai.DefaultAsyncHttpxClient(verify=ssl_context(tls_files.ca))
        bare = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, http_client=anonymous)
        with pytest.raises(openai.APIConnectionError):
            await bare.models.list()
        await trusted.aclose()
        await anonymous.aclose()
        # The load generator takes the same files, over HTTPS and over gRPC.
        for address in (base_url, f"127.0.0.1:{stack.coordinator.port}"):
            load = Load(address, None, 2, 2, None, 4, 0.0, prompts=["def f():"], security=client_security)
            summary = summarise(*await run_load(load))
            assert (summary["succeeded"], summary["errors"]) == (2, {}), (address, summary)


def ssl_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def test_domain_errors_map_to_http_statuses_and_the_parser_names_fields():
    assert api_error(InvalidArgument("bad")).status == 400
    assert api_error(ResourceExhausted("full")).status == 429
    assert api_error(Unavailable("down")).status == 503
    assert api_error(RuntimeError("bug")).status == 500
    parsed = parse_body({"prompt": [[1, 2, 3]], "max_tokens": 5, "stop": "x", "seed": 3}, chat=False)
    assert parsed.request.prompt_token_ids == (1, 2, 3) and parsed.request.stop == ("x",)
    assert parsed.request.temperature == 1.0, "OpenAI's default temperature"
    assert not parsed.request.logprobs
    legacy = parse_body({"prompt": "a", "logprobs": 0}, chat=False).request  # logprobs 0: the tokens' own only
    assert legacy.logprobs and legacy.top_logprobs == 0
    assert parse_body({"prompt": "a", "logit_bias": {"12": 5}}, chat=False).request.logit_bias == {12: 5.0}
    penalised = parse_body({"prompt": "a", "presence_penalty": 0.5, "repetition_penalty": 1.2}, chat=False).request
    assert (penalised.presence_penalty, penalised.frequency_penalty, penalised.repetition_penalty) == (0.5, 0.0, 1.2)
    chat = parse_body({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 5}, chat=True)
    assert chat.request.logprobs and chat.request.top_logprobs == 5
    for body, field in (
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "logprobs": True}, "logprobs"),  # a completion's is a count
        ({"prompt": "a", "top_logprobs": 2}, "top_logprobs"),  # chat's field
        ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"5": "high"}}, "logit_bias"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "frequency_penalty": "high"}, "frequency_penalty"),
    ):
        with pytest.raises(Exception) as error:
            parse_body(body, chat=False)
        assert error.value.param == field
