"""OpenAI's request and response shapes, as the HTTP API reads and writes them.

`parse_body` turns a /v1/completions or /v1/chat/completions body into the domain's
GenerationRequest, refusing by name every field it does not serve; `api_error` gives a domain
error OpenAI's error body and the fitting HTTP status. No HTTP server here: coordinator.openai_api
serves these.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from coordinator.metrics import GenerationStats
from coordinator.requests import CHAT_ROLES, GenerationRequest
from specdec.engine.tokens import token_bytes
from specdec.errors import shown, status_of
from specdec.sampling.logprobs import MAX_TOP_LOGPROBS
from specdec.sampling.relaxed import AcceptanceMode
from specdec.v1.common_pb2 import TokenLogprobs

# gRPC status (as specdec.errors.status_of names it) -> HTTP status and OpenAI error type.
HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# Fields a request may carry only at the value that means "off" (the official client never
# sends them unless asked); any other value is refused by name, never silently ignored.
# null is "off" for each, as the official client sends it for an argument passed as None.
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),  # the legacy form of tools
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    # OpenAI's other outputs: audio (a text-only model answers none) and web search results.
    "modalities": (None, ["text"]),
    **dict.fromkeys(("audio", "web_search_options"), (None,)),
    # vLLM's extras that change the output: constrained decoding, EOS handling, other stops,
    # other samplers, and the prompt's own logprobs.
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"), (None,)),
    **dict.fromkeys(("allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens"), (None,)),
    "ignore_eos": (None, False),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "min_p": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "logits_processors": (None, []),
    "skip_special_tokens": (None, True),  # the text leaves them out
    # ... and those that change the prompt the chat template writes.
    **dict.fromkeys(("chat_template", "documents"), (None,)),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}
IGNORED = {"model", "user", "stream", "stream_options", "store", "metadata", "service_tier"}
SAMPLING = {
    *("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "top_k", "logit_bias"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty"),  # the last as vLLM's extra
}
LOGPROBS = {"logprobs", "top_logprobs"}  # chat: logprobs true/false and top_logprobs; completions: logprobs N
MAX_CHOICES = 16  # `n`: choices per request, each a generation of its own (sessions on both services)
EXTRAS = {
    *("num_speculative_tokens", "draft_min_confidence", "tree_widths", "cache_salt", "acceptance_mode"),
    *("relaxed_top_n", "relaxed_delta"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


# GenerateRequest fields (InvalidArgument.field) by the HTTP parameter that carries them.
HTTP_PARAMS = {"prompt_token_ids": "prompt"}


def api_error(exc: BaseException, max_tokens_param: str = "max_tokens") -> ApiError:
    """A domain error as OpenAI's error body with the fitting HTTP status; a refused field is
    named as the HTTP API names it (`max_tokens`, or `max_tokens_param` where the body sent
    `max_completion_tokens`; not gRPC's `max_new_tokens`)."""
    if isinstance(exc, ApiError):
        return exc
    status, error_type = HTTP_STATUS.get(status_of(exc), (500, "internal_error"))
    message = str(exc) if status != 500 else f"internal error: {type(exc).__name__}: {exc}"
    field: str | None = getattr(exc, "field", None)
    param = None
    if field:
        param = max_tokens_param if field == "max_new_tokens" else HTTP_PARAMS.get(field, field)
        message = message.replace(field, param)
    return ApiError(status, message, error_type, param)


@dataclass(frozen=True)
class Parsed:
    """An HTTP request body as the domain request, and how to answer it."""

    request: GenerationRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    chat: bool
    n: int = 1  # choices: generations of the same request, each with its own seed (`choices`)
    ignored: tuple[str, ...] = ()  # fields no OpenAI-style server here knows: left out, as vLLM does
    max_tokens_param: str = "max_tokens"  # the body's name for it, which errors name (`api_error`)

    def choices(self) -> list[GenerationRequest]:
        """One request per choice. A seeded request's choice i draws with seed + i, so choice
        0 is what n = 1 gives and every choice is reproducible; unseeded ones draw their own."""
        seed = self.request.seed
        return [
            dataclasses.replace(self.request, seed=None if seed is None else (seed + index) % 2**64)
            for index in range(self.n)
        ]


def _number(body: dict, name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad_request(f"{name} must be {'an integer' if kind is int else 'a number'}; got {shown(value)}", name)
    try:
        return kind(value)
    except OverflowError:  # a JSON integer of hundreds of digits as a float
        raise bad_request(f"{name} is out of range; got {shown(value)}", name) from None


def _string(body: dict, name: str) -> str:
    value = body.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string; got {shown(value)}", name)
    return value


def _top_k(body: dict) -> int:
    top_k = _number(body, "top_k", int, 0)
    return 0 if top_k == -1 else top_k  # -1: vLLM's "off", as its clients send it


def _tree_widths(body: dict) -> tuple[int, ...]:
    widths = body.get("tree_widths")
    if widths is None:
        return ()
    if not isinstance(widths, list) or not all(isinstance(w, int) and not isinstance(w, bool) for w in widths):
        raise bad_request(f"tree_widths must be a list of integers; got {shown(widths)}", "tree_widths")
    return tuple(widths)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to numbers."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request(f"logit_bias must be an object of token ids to numbers; got {shown(bias)}", "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdecimal()):
            raise bad_request(f"logit_bias keys are token ids; got {shown(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"logit_bias[{key}] must be a number; got {shown(value)}", "logit_bias")
        try:
            parsed[int(key)] = float(value)
        except (ValueError, OverflowError):  # thousands of digits
            raise bad_request(f"logit_bias[{shown(key)}] is out of range", "logit_bias") from None
    return parsed


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return tuple(stop)
    raise bad_request("stop must be a string or a list of strings", "stop")


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins them
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


def parse_request_body(raw: bytes, chat: bool, model_name: str) -> Parsed:
    """A request body as it arrived (at most the API's body limit): JSON, validated, for this
    model. Work in proportion to the body's size, so the API runs it off the event loop."""
    try:
        body = json.loads(raw)
        if re.search(rb"\\u[dD][89a-fA-F]", raw):  # a surrogate escaped ("\\ud800") alone is a str no text holds
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the request body escapes a lone UTF-16 surrogate (\\ud800-\\udfff): not text") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not JSON: {shown(str(exc), quote=False)}") from None
    except RecursionError:
        raise bad_request(
            "the request body nests deeper than a request can (JSON arrays or objects in thousands)"
        ) from None
    parsed = parse_body(body, chat)
    model = body.get("model")
    if model not in (None, model_name):
        raise ApiError(404, f"model {shown(model)} is not served here; this server serves {model_name!r}",
                       "not_found_error", "model", "model_not_found")  # fmt: skip
    return parsed


def parse_body(body: Any, chat: bool) -> Parsed:
    """Validates an OpenAI request body; every refusal names the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    prompt_field = "messages" if chat else "prompt"
    known = {prompt_field, "n", *SAMPLING, *LOGPROBS, *EXTRAS, *IGNORED, *OFF_VALUES}
    # A field nobody here knows is left out, as vLLM's server does (clients send their own
    # extras); one that would change the output where it is not supported is refused below.
    ignored = tuple(sorted(name for name in body if name not in known))
    _check_off_values(body)
    fields = _chat_fields(body) if chat else _completion_fields(body)
    max_tokens = _number(body, "max_completion_tokens", int, _number(body, "max_tokens", int))
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if options and not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    request = _generation_request(body, chat, fields, max_tokens)
    n = _number(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}]; got {n}", "n")
    newer = body.get("max_completion_tokens") is not None
    max_tokens_param = "max_completion_tokens" if newer else "max_tokens"
    return Parsed(request, stream, bool(options.get("include_usage")), chat, n, ignored, max_tokens_param)


def _check_off_values(body: dict) -> None:
    """Refuses a field this server does not serve unless it is at its "off" value (OFF_VALUES)."""
    for name, accepted in OFF_VALUES.items():
        if name in body and body[name] not in accepted:
            off = " or ".join(json.dumps(value) for value in accepted)
            raise bad_request(f"{name}={shown(body[name])} is not supported; leave it out (or send {off})", name)


def _chat_fields(body: dict) -> dict[str, Any]:
    """A chat request's prompt: its messages as (role, content) turns."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        role = "system" if role == "developer" else role  # OpenAI's newer name for the system turn
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{index}].role is {shown(role)}; use one of {', '.join(CHAT_ROLES)}", "messages"
            )
        turns.append((role, _content(message, index)))
    return {"messages": tuple(turns)}


def _completion_fields(body: dict) -> dict[str, Any]:
    """A completion request's prompt: text, or token ids; a batch of one prompt is that prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": tuple(prompt)}
    raise bad_request("prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def _generation_request(body: dict, chat: bool, fields: dict[str, Any], max_tokens: int | None) -> GenerationRequest:
    """The domain request from the body's sampling fields, extras and logprobs, each checked
    in turn; `fields` holds its prompt."""
    request = GenerationRequest(
        **fields,
        max_new_tokens=max_tokens,
        fill_context=True,  # an unset max_tokens: the rest of the context, as vLLM's server
        # OpenAI's default temperature is 1; 0 is greedy, as in the gRPC API.
        temperature=_number(body, "temperature", float, 1.0),
        top_p=_number(body, "top_p", float),
        top_k=_top_k(body),
        seed=_number(body, "seed", int),
        stop=_stop(body),
        logit_bias=_logit_bias(body),
        presence_penalty=_number(body, "presence_penalty", float, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", float, 0.0),
        repetition_penalty=_number(body, "repetition_penalty", float),
        num_speculative_tokens=_number(body, "num_speculative_tokens", int),
        draft_min_confidence=_number(body, "draft_min_confidence", float),
        tree_widths=_tree_widths(body),
        cache_salt=_string(body, "cache_salt"),
        acceptance_mode=_string(body, "acceptance_mode"),
        relaxed_top_n=_number(body, "relaxed_top_n", int),
        relaxed_delta=_number(body, "relaxed_delta", float),
    )
    if request.seed is not None:  # any 64-bit integer, signed (as vLLM takes it) or not: its bits
        if not -(2**63) <= request.seed < 2**64:
            raise bad_request(f"seed must be a 64-bit integer, in [-2^63, 2^64); got {shown(request.seed)}", "seed")
        request = dataclasses.replace(request, seed=request.seed % 2**64)
    logprobs, top_logprobs = _logprobs(body, chat)
    return dataclasses.replace(request, logprobs=logprobs, top_logprobs=top_logprobs)


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """Whether to return logprobs, and how many likeliest tokens at each position: chat's
    `logprobs` (true/false) and `top_logprobs`; a completion's `logprobs` (that count)."""
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise bad_request(f"logprobs must be true or false; got {shown(wanted)}", "logprobs")
        top = _number(body, "top_logprobs", int, 0)
        if top and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        name = "top_logprobs"
    else:
        if "top_logprobs" in body:
            raise bad_request("top_logprobs is a chat field; a completion's logprobs gives the count", "top_logprobs")
        count = _number(body, "logprobs", int)
        wanted, top, name = count is not None, count or 0, "logprobs"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]; got {top}", name)
    return bool(wanted), top


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """A token's own text, from its bytes: decoding it alone would drop a SentencePiece
    token's leading space (the decoder strips the text's first), and U+FFFD where it ends
    inside a character, as there."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], entries: list[TokenLogprobs]) -> dict:
    """A chat choice's `logprobs`: per token its text, logprob, UTF-8 bytes and the likeliest
    tokens at its position (common.proto TokenLogprobs: the target's raw distribution). The
    bytes are the token's own (specdec.engine.tokens), so a client joining them gets the text back
    where a character spans tokens and each token's text alone is U+FFFD."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token_id))}

    return {
        "content": [
            {
                **entry(token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)],
            }
            for token_id, lp in zip(token_ids, entries, strict=True)
        ]
    }


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], entries: list[TokenLogprobs], offset: int = 0
) -> dict:
    """A completion choice's `logprobs` (the legacy shape): the tokens' texts, their logprobs,
    the likeliest at each position as {text: logprob}, and each token's offset in the text
    (from `offset`, the characters streamed before)."""
    texts = [token_text(tokenizer, token_id) for token_id in token_ids]
    offsets = list(itertools.accumulate((len(text) for text in texts[:-1]), initial=offset))[: len(texts)]
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [
            {token_text(tokenizer, t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for lp in entries
        ],
        "text_offset": offsets,
    }


def speculation(*choices: GenerationStats) -> dict:
    """The response's `speculation` extras, over every choice (`n`); `acceptance_mode` says
    which rule produced the text (relaxed output is not the target's), and a relaxed response
    adds its parameters and the tokens only the relaxed rule accepted."""
    stats = choices[0]
    total = GenerationStats(  # the choices' rounds as one request's, for its derived figures
        rounds=sum(choice.rounds for choice in choices),
        proposed_tokens=sum(choice.proposed_tokens for choice in choices),
        accepted_tokens=sum(choice.accepted_tokens for choice in choices),
        recovered_tokens=sum(choice.recovered_tokens for choice in choices),
        bonus_tokens=sum(choice.bonus_tokens for choice in choices),
    )
    figures = {
        "acceptance_rate": round(total.acceptance_rate, 4),
        "tokens_per_round": round(total.mean_accepted_length, 4),
        "rounds": total.rounds,
        "proposed_tokens": total.proposed_tokens,
        "accepted_tokens": total.accepted_tokens,
        "target_numerics": stats.target_numerics,
        "acceptance_mode": stats.acceptance_mode,
    }
    if stats.acceptance_mode == AcceptanceMode.RELAXED.value:
        figures["relaxed_top_n"] = stats.relaxed_top_n
        figures["relaxed_delta"] = round(stats.relaxed_delta, 4)
        figures["relaxed_accepted_tokens"] = sum(choice.relaxed_accepted_tokens for choice in choices)
    return figures


def usage(*choices: GenerationStats) -> dict:
    """The request's usage: its prompt once, every choice's completion."""
    completion = sum(stats.generated_tokens for stats in choices)
    return {
        "prompt_tokens": choices[0].prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": choices[0].prompt_tokens + completion,
    }
