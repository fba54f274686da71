"""A client's request as the domain sees it, and its validation into a Job: every refusal
says what was wrong and what is accepted."""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from coordinator.config import FALLBACK_K, CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo
from specdec.errors import InvalidArgument, shown
from specdec.sampling.logprobs import check_top_logprobs
from specdec.sampling.probs import MIN_TEMPERATURE, SamplingParams, check_logit_bias, check_penalties
from specdec.sampling.relaxed import AcceptanceMode, RelaxedAcceptance, check_relaxed
from specdec.sampling.tree_sampling import MAX_TREE_NODES, tree_size
from specdec.v1 import common_pb2

MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # the wire's float32: above, the services would read inf


@dataclass(frozen=True)
class GenerationRequest:
    """A client request as the domain sees it (fields as in GenerateRequest; None = unset).
    The sequences may be views of the request as it arrived: `prepare_job` checks their
    lengths before it reads them."""

    prompt: str = ""
    prompt_token_ids: Sequence[int] = ()
    max_new_tokens: int | None = None
    # Where max_new_tokens is unset: the rest of the model's context (up to the server's
    # --max-new-tokens-limit), and where set past it a refusal, as vLLM's HTTP API does;
    # otherwise CoordinatorConfig.default_max_new_tokens, and a generation the context cuts short.
    fill_context: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    num_speculative_tokens: int | None = None
    draft_min_confidence: float | None = None
    messages: Sequence[tuple[str, str]] = ()  # (role, content): rendered with the chat template
    tree_widths: Sequence[int] = ()  # tree speculation: children per node at each depth
    cache_salt: str = ""  # the request's own cache namespace (GenerateRequest.cache_salt)
    acceptance_mode: str = ""  # "exact" or "relaxed"; "" the server's default (GenerateRequest.acceptance_mode)
    relaxed_top_n: int | None = None
    relaxed_delta: float | None = None
    tenant: str = ""  # the caller's bearer token, where the coordinator checks tokens; "" otherwise
    logprobs: bool = False  # each token's log-probability under the target (GenerateRequest.logprobs)
    top_logprobs: int = 0  # ... with this many likeliest tokens at its position
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: off (1.0)


CHAT_ROLES = ("system", "user", "assistant")
MAX_CACHE_SALT_CHARS = 256
# A request's stop strings: as many and as long as vLLM-style clients send, bounded so that
# the largest valid request is known before it is decoded (`request_limit_bytes`).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class Job:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...]
    num_speculative_tokens: int
    num_speculative_tokens_unset: bool = (
        False  # K is the chooser's: neither the request nor --num-speculative-tokens fixed it
    )
    seeded: bool = False  # the request set its seed: K may not depend on other requests
    draft_min_confidence: float | None = None  # None: the draft service's default
    tree_widths: tuple[int, ...] = ()  # each round proposes and verifies this tree (K is then 0)
    cache_namespace: str = ""  # whose cached prompts and outputs the services may reuse (cache_namespace())
    relaxed: RelaxedAcceptance | None = None  # relaxed acceptance (lossy); None: exact
    top_logprobs: int | None = None  # GenerateRequest.logprobs: its top_logprobs; None: no logprobs

    @property
    def seeded_sampled(self) -> bool:
        """A seeded sampled request: its output depends on K and copy lengths, so those may
        depend on nothing but the request itself (greedy output is the target's whatever K is)."""
        return self.seeded and not self.params.greedy

    @property
    def acceptance_mode(self) -> AcceptanceMode:
        return AcceptanceMode.EXACT if self.relaxed is None else AcceptanceMode.RELAXED


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, where asked for


def chat_prompt_ids(messages: Sequence[tuple[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The conversation rendered with the tokenizer's own chat template, the assistant's turn
    opened, as token ids. The template writes the special tokens itself, so the text is
    encoded without adding more (as vLLM and transformers' pipelines do)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(
            "messages need a chat template, and this model's tokenizer has none; send prompt (raw text) instead",
            field="messages",
        )
    for index, (role, _) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{index}].role is {shown(role)}; use one of {', '.join(CHAT_ROLES)}", field="messages"
            )
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. roles out of order) is the client's
        raise InvalidArgument(
            f"the model's chat template refused these messages: {shown(str(exc), quote=False)}", field="messages"
        ) from exc
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not prompt_ids:
        raise InvalidArgument("the messages render to no tokens", field="messages")
    return prompt_ids


def check_prompt_length(tokens: int, pair: PairInfo, field: str) -> None:
    if tokens >= pair.max_context:
        raise InvalidArgument(
            f"prompt has {tokens} tokens; the model's context is {pair.max_context}, "
            f"so at most {pair.max_context - 1} prompt tokens are accepted",
            field=field,
        )


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes one token decodes to (Qwen2.5: 128, a run of spaces). A token's
    vocabulary string is never shorter in UTF-8 than its text (byte-level BPE writes each byte
    as one 1-2-byte character, SentencePiece a space as the 3-byte "▁"), so only the tokens
    whose strings are longer than the best decoded so far are decoded: a few, not 150k."""
    by_length = sorted(((len(token.encode()), index) for token, index in tokenizer.get_vocab().items()), reverse=True)
    longest = 1
    for string_bytes, index in by_length:
        if string_bytes <= longest:
            break
        longest = max(longest, len(str(tokenizer.decode([index])).encode()))
    return longest


# A GenerateRequest's fields other than the prompt, the messages and the stop strings (numbers,
# tree widths, field tags), with room to spare.
FIXED_REQUEST_BYTES = 4096
# One ChatMessage on the wire beyond its content: its tag and length, the role's tag, length
# and longest name ("assistant"), and the content's tag and length prefix.
MESSAGE_OVERHEAD_BYTES = 32


def request_limit_bytes(config: CoordinatorConfig, pair: PairInfo, token_bytes: int) -> int:
    """The largest GenerateRequest a valid request can be, on the wire: the public API refuses
    anything larger before decoding it (gRPC: RESOURCE_EXHAUSTED; HTTP: 413). A prompt holds
    fewer than max_context tokens, so as ids fewer than max_context varints of the vocabulary's
    width, as text at most `token_bytes` bytes a token, and as messages, as many and at most one
    token each (a chat template renders each message to at least one), holding that text between
    them; stop strings are bounded by the config. A request sets one of the three prompt forms,
    so the largest of them counts (one that sets more is refused once decoded).

    Decoding stays in proportion: at worst ~15 ns a byte of empty repeated entries (Qwen2.5's
    5.3 MB limit: 80 ms), and no entry is read past the counts `prepare_job` checks first."""
    ids = pair.max_context * varint_bytes(pair.vocab_size - 1)
    text = pair.max_context * token_bytes
    messages = text + pair.max_context * MESSAGE_OVERHEAD_BYTES
    stop = MAX_STOP_STRINGS * (4 * MAX_STOP_STRING_CHARS + 8)  # UTF-8: 4 bytes a character at most
    return FIXED_REQUEST_BYTES + max(ids, text, messages) + stop


def varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def prompt_ids_of(request: GenerationRequest, pair: PairInfo, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The request's prompt as token ids, from whichever of its three forms it sets; lengths
    are checked before any per-entry work."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise InvalidArgument(f"set exactly one of prompt, prompt_token_ids and messages; got {' and '.join(given)}")
    if request.messages:
        if len(request.messages) >= pair.max_context:  # each renders to at least one token: before templating
            raise InvalidArgument(
                f"messages has {len(request.messages)} turns; the prompt they render to cannot fit the model's "
                f"context of {pair.max_context} tokens (each turn renders to at least one)",
                field="messages",
            )
        prompt_ids = chat_prompt_ids(request.messages, tokenizer)
    elif request.prompt:
        prompt_ids = list(tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
        if not prompt_ids:
            raise InvalidArgument("prompt encodes to no tokens; send non-empty text", field="prompt")
    elif request.prompt_token_ids:
        check_prompt_length(len(request.prompt_token_ids), pair, "prompt_token_ids")  # before any per-id work
        try:
            ids = np.asarray(request.prompt_token_ids, dtype=np.int64)  # [N]
        except OverflowError:  # an HTTP body's id past 64 bits (gRPC's are int32)
            raise InvalidArgument("prompt_token_ids holds an id past 64 bits", field="prompt_token_ids") from None
        outside = np.flatnonzero((ids < 0) | (ids >= pair.vocab_size))
        if outside.size:
            i = int(outside[0])
            raise InvalidArgument(
                f"prompt_token_ids[{i}] = {ids[i]} is outside the vocabulary; ids must be in [0, {pair.vocab_size})",
                field="prompt_token_ids",
            )
        return ids.tolist()  # its length was checked above, before any id was read
    else:
        raise InvalidArgument("prompt is empty: set prompt (text), prompt_token_ids or messages")
    check_prompt_length(len(prompt_ids), pair, given[0])
    return prompt_ids


def prepare_job(
    request: GenerationRequest, config: CoordinatorConfig, pair: PairInfo, tokenizer: PreTrainedTokenizerBase
) -> Job:
    """Validates a request; every failure says what was wrong and what is accepted."""
    prompt_ids = prompt_ids_of(request, pair, tokenizer)
    max_new_tokens = max_new_tokens_of(request, config, pair.max_context - len(prompt_ids))
    top_p = checked_top_p(request)
    k, k_chosen = speculative_tokens_of(request, config, pair)
    check_stop_strings(request.stop)
    check_draft_min_confidence(request.draft_min_confidence)
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(
            f"cache_salt has {len(request.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}", field="cache_salt"
        )
    top_logprobs = check_top_logprobs(request.top_logprobs, request.logprobs)
    params = sampling_params_of(request, pair, top_p)
    relaxed = acceptance_of(request, config)
    seed = secrets.randbits(63) if request.seed is None else request.seed
    if request.tree_widths:
        check_tree_request(request, pair)
        k = 0  # no chain: the round loop proposes the tree instead
    return Job(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        params=params,
        seed=seed,
        stop=tuple(request.stop),
        num_speculative_tokens=k,
        num_speculative_tokens_unset=k_chosen,
        seeded=request.seed is not None,
        draft_min_confidence=request.draft_min_confidence,
        tree_widths=tuple(request.tree_widths),
        cache_namespace=cache_namespace(request.cache_salt, request.tenant),
        relaxed=relaxed,
        top_logprobs=top_logprobs,
    )


def max_new_tokens_of(request: GenerationRequest, config: CoordinatorConfig, context_left: int) -> int:
    """The request's token budget, or where it sets none the server's default or, for a
    request that fills the context, the `context_left` after its prompt (at least 1: a prompt
    is shorter than the context), within --max-new-tokens-limit (a default above it is cut to
    it: the client asked for nothing the limit refuses)."""
    if request.max_new_tokens is None and request.fill_context:
        return min(context_left, config.max_new_tokens_limit)
    max_new_tokens = request.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = min(config.default_max_new_tokens, config.max_new_tokens_limit)
    if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens must be in [1, {config.max_new_tokens_limit}]; got {max_new_tokens}",
            field="max_new_tokens",
        )
    if request.fill_context and max_new_tokens > context_left:  # the HTTP API's: refused, as vLLM's and OpenAI's
        raise InvalidArgument(
            f"max_new_tokens={max_new_tokens} does not fit: the prompt leaves {context_left} tokens of the model's "
            f"context; ask for at most {context_left}, or shorten the prompt",
            field="max_new_tokens",
        )
    return max_new_tokens


def checked_top_p(request: GenerationRequest) -> float:
    """Checks the temperature and top_k, then returns top_p (1.0, off, where unset)."""
    if not (request.temperature == 0 or MIN_TEMPERATURE <= request.temperature <= MAX_TEMPERATURE):
        raise InvalidArgument(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:.6g}] (smaller ones "
            f"overflow the logits, larger ones the wire's float32); got {request.temperature}",
            field="temperature",
        )
    if not 0 <= request.top_k < 2**31:  # the wire's int32
        raise InvalidArgument(f"top_k must be in [0, 2^31) (0 = off); got {request.top_k}", field="top_k")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgument(f"top_p must be in (0, 1] (1.0 = off); got {top_p}", field="top_p")
    return top_p


def speculative_tokens_of(request: GenerationRequest, config: CoordinatorConfig, pair: PairInfo) -> tuple[int, bool]:
    """The chain's K, and whether it is the chooser's to pick (neither the request nor the
    server fixed it)."""
    k_chosen = request.num_speculative_tokens is None and config.default_num_speculative_tokens is None
    if request.num_speculative_tokens is None:
        # The configured K, or the chooser's (FALLBACK_K where it has no costs), within what
        # both services accept.
        k = config.default_num_speculative_tokens
        k = min(FALLBACK_K if k is None else k, pair.max_num_speculative_tokens)
    else:
        k = request.num_speculative_tokens
    if not 0 <= k <= pair.max_num_speculative_tokens:
        raise InvalidArgument(
            f"num_speculative_tokens must be in [0, {pair.max_num_speculative_tokens}] (0 = target only); got {k}",
            field="num_speculative_tokens",
        )
    return k, k_chosen


def check_stop_strings(stops: Sequence[str]) -> None:
    """Checks the stop strings against the bounds `request_limit_bytes` counts on: their number
    first, before any string is read."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted", field="stop")
    for stop in stops:
        if not 0 < len(stop) <= MAX_STOP_STRING_CHARS:
            raise InvalidArgument(
                f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters; got one of {len(stop)}",
                field="stop",
            )


def check_draft_min_confidence(confidence: float | None) -> None:
    """An unset confidence is the draft service's default; a set one is a probability."""
    if confidence is not None and not (math.isfinite(confidence) and 0.0 <= confidence <= 1.0):
        raise InvalidArgument(
            f"draft_min_confidence must be in [0, 1] (0 = never stop early); got {confidence}",
            field="draft_min_confidence",
        )


def sampling_params_of(request: GenerationRequest, pair: PairInfo, top_p: float) -> SamplingParams:
    """The request's sampling parameters, its logit bias and penalties checked, and refused
    where they cannot apply: penalties to a tree, a bias to a token past the target's vocabulary."""
    bias = check_logit_bias(dict(request.logit_bias))
    repetition = 1.0 if request.repetition_penalty is None else request.repetition_penalty
    check_penalties(request.presence_penalty, request.frequency_penalty, repetition)
    params = SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=top_p,
        logit_bias=bias,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=repetition,
    )
    if params.penalizes and request.tree_widths:
        raise InvalidArgument(
            "penalties do not apply to token trees (tree_widths): each node would need a history of its own; "
            "leave tree_widths out",
            field="tree_widths",
        )
    if params.logit_bias and params.logit_bias[-1][0] >= pair.vocab_size:
        raise InvalidArgument(
            f"logit_bias names token {params.logit_bias[-1][0]}; the target's vocabulary has {pair.vocab_size} ids",
            field="logit_bias",
        )
    return params


def acceptance_of(request: GenerationRequest, config: CoordinatorConfig) -> RelaxedAcceptance | None:
    """The request's relaxed parameters, or None for exact acceptance. An unset mode takes the
    server's default (exact), except for a tree request: trees are verified exactly only.
    Relaxed parameters in an exact request are refused rather than ignored: the client asked
    for something it would not get."""
    mode = request.acceptance_mode
    if mode and mode not in AcceptanceMode.names():
        raise InvalidArgument(
            f"acceptance_mode must be one of {', '.join(AcceptanceMode.names())} (unset: the server's default, "
            f"{config.acceptance}); got {shown(mode)}",
            field="acceptance_mode",
        )
    if mode == AcceptanceMode.RELAXED.value and request.tree_widths:
        raise InvalidArgument(
            "acceptance_mode relaxed does not apply to token trees (tree_widths), which are verified exactly only; "
            "send a chain (num_speculative_tokens) or acceptance_mode exact",
            field="acceptance_mode",
        )
    if not mode:
        mode = AcceptanceMode.EXACT.value if request.tree_widths else config.acceptance
    if mode == AcceptanceMode.EXACT.value:
        for name in ("relaxed_top_n", "relaxed_delta"):
            if getattr(request, name) is not None:
                raise InvalidArgument(
                    f"{name} applies only to acceptance_mode relaxed, and this request's mode is exact "
                    f"({'as sent' if request.acceptance_mode else 'the default for this request'}); "
                    f"set acceptance_mode to relaxed, or leave {name} out",
                    field=name,
                )
        return None
    top_n = config.relaxed_top_n if request.relaxed_top_n is None else request.relaxed_top_n
    delta = config.relaxed_delta if request.relaxed_delta is None else request.relaxed_delta
    return check_relaxed(top_n, delta)


def cache_namespace(salt: str, tenant: str) -> str:
    """The services' cache namespace for a request: "" (shared) with neither a salt nor a
    checked bearer token, else a hash of both, so no token travels to the model services and
    no two tenants, or salts, share one."""
    if not salt and not tenant:
        return ""
    return hashlib.blake2b(f"{tenant}\0{salt}".encode(), digest_size=16).hexdigest()


def check_tree_request(request: GenerationRequest, pair: PairInfo) -> None:
    """Trees replace the chain's K, take no confidence stop, and fit both services' limits."""
    widths = request.tree_widths
    if not pair.trees:
        raise InvalidArgument(
            "tree_widths: this deployment's draft or target does not serve token trees (the n-gram drafter proposes "
            "chains only); send num_speculative_tokens instead",
            field="tree_widths",
        )
    if request.num_speculative_tokens is not None or request.draft_min_confidence is not None:
        raise InvalidArgument(
            "tree_widths replaces num_speculative_tokens and takes no draft_min_confidence; send one",
            field="tree_widths",
        )
    if len(widths) > pair.max_num_speculative_tokens or any(width < 1 for width in widths):
        raise InvalidArgument(
            f"tree_widths {shown(list(widths))}: each width must be >= 1 and the depth at most "
            f"{pair.max_num_speculative_tokens}",
            field="tree_widths",
        )
    if tree_size(widths) > MAX_TREE_NODES:
        raise InvalidArgument(
            f"tree_widths {shown(list(widths))} make a tree of {tree_size(widths)} nodes; at most {MAX_TREE_NODES}",
            field="tree_widths",
        )
