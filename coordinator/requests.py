"""A client's request as the domain sees it, and its validation into a Job: every refusal
says what was wrong and what is accepted."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from coordinator.adaptive import RoundCosts
from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from specdec.calls import numerics
from specdec.errors import InvalidArgument
from specdec.probs import SamplingParams
from specdec.tree_sampling import MAX_TREE_NODES, tree_size

# Below this, logits / temperature overflows float32 to inf and the distributions become NaN;
# such a temperature is greedy in all but ties anyway (vLLM treats < 1e-5 as greedy). Rounded
# to float32 as the request carries it, so a client that sends 1e-5 is accepted.
MIN_TEMPERATURE = float(np.float32(1e-5))


@dataclass(frozen=True)
class GenerationRequest:
    """A client request as the domain sees it (fields as in GenerateRequest; None = unset)."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None
    draft_min_confidence: float | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content): rendered with the chat template
    tree_widths: tuple[int, ...] = ()  # tree speculation: children per node at each depth


CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PairInfo:
    """What start-up learned from both services' Info."""

    vocab_size: int  # the target's logit width: ids valid in a request and in the output
    draft_vocab_size: int  # the draft's; may differ (Qwen2.5-0.5B has 151,936 columns, 7B 152,064)
    eos_token_ids: frozenset[int]
    max_context: int  # the target's
    draft_max_context: int
    max_num_speculative_tokens: int  # the config's maximum, capped by both services'
    costs: RoundCosts | None = None  # measured pass and RPC costs; None when a service did not calibrate
    target_model_id: str = ""  # as the target's Info reports it (the HTTP API's default model name)
    draft_copies: bool = False  # the draft copies by prompt lookup (ModelInfo.copies)
    trees: bool = False  # both services serve token trees (ModelInfo.trees)
    target_numerics: str = ""  # what computes the target's logits (specdec.calls.numerics)

    @property
    def draft_vocab_limit(self) -> int:
        """ProposeRequest.vocab_limit: the target's width when the draft's logits are wider."""
        return self.vocab_size if self.draft_vocab_size > self.vocab_size else 0

    def for_draft(self, token_ids: list[int]) -> list[int]:
        """Committed tokens as the draft is sent them: an id the draft cannot embed (the
        target's logits are wider) becomes one it can. Exact: the draft's proposals only have
        to come with the distributions they were drawn from, whatever context produced them;
        only their acceptance rate changes."""
        if self.draft_vocab_size >= self.vocab_size:
            return token_ids
        unknown = min(self.eos_token_ids, default=0)
        unknown = unknown if unknown < self.draft_vocab_size else 0
        return [token if token < self.draft_vocab_size else unknown for token in token_ids]


@dataclass(frozen=True)
class Job:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...]
    num_speculative_tokens: int
    num_speculative_tokens_unset: bool = False  # the request left K to the coordinator
    seeded: bool = False  # the request set its seed: K may not depend on other requests
    draft_min_confidence: float | None = None  # None: the draft service's default
    tree_widths: tuple[int, ...] = ()  # each round proposes and verifies this tree (K is then 0)


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None


def chat_prompt_ids(messages: tuple[tuple[str, str], ...], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The conversation rendered with the tokenizer's own chat template, the assistant's turn
    opened, as token ids. The template writes the special tokens itself, so the text is
    encoded without adding more (as vLLM and transformers' pipelines do)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(
            "messages need a chat template, and this model's tokenizer has none; send prompt (raw text) instead"
        )
    for index, (role, _) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{index}].role is {role!r}; use one of {', '.join(CHAT_ROLES)}")
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. roles out of order) is the client's
        raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from exc
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not prompt_ids:
        raise InvalidArgument("the messages render to no tokens")
    return prompt_ids


def pair_info(config: CoordinatorConfig, draft_info, target_info, costs: RoundCosts | None) -> PairInfo:
    """What the coordinator knows of the pair, from both services' Info (at start-up, and
    again from the draft's when a restarted draft refuses a call)."""
    return PairInfo(
        vocab_size=target_info.vocab_size,
        draft_vocab_size=draft_info.vocab_size,
        eos_token_ids=frozenset(target_info.eos_token_ids),
        max_context=target_info.max_context,
        draft_max_context=draft_info.max_context,
        max_num_speculative_tokens=min(
            config.max_num_speculative_tokens, draft_info.max_speculative_tokens, target_info.max_speculative_tokens
        ),
        costs=costs,
        target_model_id=target_info.model_id,
        draft_copies=draft_info.copies,
        trees=draft_info.trees and target_info.trees,
        target_numerics=numerics(target_info.dtype, target_info.quantization),
    )


def prepare_job(
    request: GenerationRequest, config: CoordinatorConfig, pair: PairInfo, tokenizer: PreTrainedTokenizerBase
) -> Job:
    """Validates a request; every failure says what was wrong and what is accepted."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise InvalidArgument(f"set exactly one of prompt, prompt_token_ids and messages; got {' and '.join(given)}")
    if request.messages:
        prompt_ids = chat_prompt_ids(request.messages, tokenizer)
    elif request.prompt:
        prompt_ids = list(tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
        if not prompt_ids:
            raise InvalidArgument("prompt encodes to no tokens; send non-empty text")
    elif request.prompt_token_ids:
        prompt_ids = list(request.prompt_token_ids)
        for i, token in enumerate(prompt_ids):
            if not 0 <= token < pair.vocab_size:
                raise InvalidArgument(
                    f"prompt_token_ids[{i}] = {token} is outside the vocabulary; ids must be in [0, {pair.vocab_size})"
                )
    else:
        raise InvalidArgument("prompt is empty: set prompt (text), prompt_token_ids or messages")
    if len(prompt_ids) >= pair.max_context:
        raise InvalidArgument(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {pair.max_context}, "
            f"so at most {pair.max_context - 1} prompt tokens are accepted"
        )
    max_new_tokens = config.default_max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
    if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
        raise InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}]; got {max_new_tokens}")
    if not (
        math.isfinite(request.temperature) and (request.temperature == 0 or request.temperature >= MIN_TEMPERATURE)
    ):
        raise InvalidArgument(
            f"temperature must be a finite number >= 0 (0 = greedy), and if positive at least {MIN_TEMPERATURE:g} "
            f"(smaller ones overflow the logits); got {request.temperature}"
        )
    if request.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 = off); got {request.top_k}")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgument(f"top_p must be in (0, 1] (1.0 = off); got {top_p}")
    if request.num_speculative_tokens is None:
        # The configured default, within what both services accept.
        k = min(config.default_num_speculative_tokens, pair.max_num_speculative_tokens)
    else:
        k = request.num_speculative_tokens
    if not 0 <= k <= pair.max_num_speculative_tokens:
        raise InvalidArgument(
            f"num_speculative_tokens must be in [0, {pair.max_num_speculative_tokens}] (0 = target only); got {k}"
        )
    if len(request.stop) > config.max_stop_strings:
        raise InvalidArgument(f"stop has {len(request.stop)} strings; at most {config.max_stop_strings} are accepted")
    for stop in request.stop:
        if not 0 < len(stop) <= config.max_stop_string_chars:
            raise InvalidArgument(
                f"stop strings must have 1 to {config.max_stop_string_chars} characters; got one of {len(stop)}"
            )
    confidence = request.draft_min_confidence
    if confidence is not None and not (math.isfinite(confidence) and 0.0 <= confidence <= 1.0):
        raise InvalidArgument(f"draft_min_confidence must be in [0, 1] (0 = never stop early); got {confidence}")
    seed = secrets.randbits(63) if request.seed is None else request.seed
    if request.tree_widths:
        check_tree_request(request, pair)
        k = 0  # no chain: the round loop proposes the tree instead
    return Job(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        params=SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=top_p),
        seed=seed,
        stop=tuple(request.stop),
        num_speculative_tokens=k,
        num_speculative_tokens_unset=request.num_speculative_tokens is None,
        seeded=request.seed is not None,
        draft_min_confidence=confidence,
        tree_widths=tuple(request.tree_widths),
    )


def check_tree_request(request: GenerationRequest, pair: PairInfo) -> None:
    """Trees replace the chain's K, take no confidence stop, and fit both services' limits."""
    widths = request.tree_widths
    if not pair.trees:
        raise InvalidArgument(
            "tree_widths: this deployment's draft or target does not serve token trees (the n-gram drafter proposes "
            "chains only); send num_speculative_tokens instead"
        )
    if request.num_speculative_tokens is not None or request.draft_min_confidence is not None:
        raise InvalidArgument("tree_widths replaces num_speculative_tokens and takes no draft_min_confidence; send one")
    if any(width < 1 for width in widths) or len(widths) > pair.max_num_speculative_tokens:
        raise InvalidArgument(
            f"tree_widths {list(widths)}: each width must be >= 1 and the depth at most "
            f"{pair.max_num_speculative_tokens}"
        )
    if tree_size(widths) > MAX_TREE_NODES:
        raise InvalidArgument(
            f"tree_widths {list(widths)} make a tree of {tree_size(widths)} nodes; at most {MAX_TREE_NODES}"
        )
