"""What the draft and target runners share: a loaded model, its sessions, and an incremental
forward pass that runs only the tokens the session's KV cache has not seen."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdec.errors import InvalidArgument
from specdec.modeling import LoadedModel
from specdec.sessions import KVSession, SessionStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelDescription:
    """Runner-side view of the Info RPC."""

    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    dtype: str
    device: str
    open_sessions: int
    max_speculative_tokens: int
    kv_cache_bytes: int = 0  # held over all sessions
    max_kv_cache_bytes: int = 0  # the budget; 0 = none
    kv_bytes_per_token: int = 0  # what one cached token costs
    evicted_sessions: int = 0  # dropped to fit the budget since start

    @classmethod
    def of(cls, source, dtype: str, device: str, open_sessions: int, max_speculative_tokens: int) -> ModelDescription:
        """From a LoadedModel or a TokenizerInfo: both carry the model's id space."""
        return cls(
            model_id=source.model_id,
            vocab_size=source.vocab_size,
            tokenizer_fingerprint=source.tokenizer_fingerprint,
            eos_token_ids=source.eos_token_ids,
            max_context=source.max_context,
            dtype=dtype,
            device=device,
            open_sessions=open_sessions,
            max_speculative_tokens=max_speculative_tokens,
        )


class ModelRunner:
    """A causal LM with per-session KV caches. Not thread-safe: one thread drives it."""

    def __init__(self, loaded: LoadedModel, max_sessions: int, session_ttl_s: float, max_speculative_tokens: int, max_kv_bytes: int = 0):
        self.loaded = loaded
        self.model = loaded.model
        self.max_speculative_tokens = max_speculative_tokens
        self.sessions = SessionStore(max_sessions, session_ttl_s, lambda: DynamicCache(config=self.model.config), max_kv_bytes)
        self.kv_bytes_per_token = kv_bytes_per_token(self.model)
        # Tokens run through the model since start; tests use it to prove prefixes are reused.
        self.processed_tokens_total = 0

    def describe(self) -> ModelDescription:
        dtype = self.loaded.dtype_label or str(self.model.dtype).removeprefix("torch.")
        description = ModelDescription.of(self.loaded, dtype, self.loaded.device_label, len(self.sessions), self.max_speculative_tokens)
        return dataclasses.replace(
            description, kv_cache_bytes=self.sessions.kv_bytes(), max_kv_cache_bytes=self.sessions.max_kv_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token, evicted_sessions=self.sessions.evicted,
        )

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_sessions(self) -> int:
        return self.sessions.expire()

    def check_tokens(self, token_ids: list[int], what: str) -> None:
        check_token_ids(token_ids, self.loaded.vocab_size, what)

    def check_length(self, total: int) -> None:
        check_context(total, self.loaded.max_context)

    @torch.inference_mode()
    def forward(self, session: KVSession, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Runs `token_ids` on top of the session's cache; returns the last positions' logits.

        token_ids: [N] → logits [min(logits_to_keep, N), V] (float32, on the model's device)
        """
        start = session.cached_tokens
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)  # [1, N]
        cache_position = torch.arange(start, start + len(token_ids), device=self.loaded.device)  # [N]
        try:
            self.sessions.make_room(session, len(token_ids) * self.kv_bytes_per_token, self.kv_bytes_per_token)
            out = self.model(
                input_ids=input_ids,
                past_key_values=session.cache,
                cache_position=cache_position,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        except BaseException:
            # A half-updated cache cannot be trusted (nor a session that does not fit the KV
            # budget be kept); the caller re-prefills on NOT_FOUND.
            self.sessions.end(session.session_id)
            raise
        self.processed_tokens_total += len(token_ids)
        return out.logits[0].float()  # [min(logits_to_keep, N), V]


def kv_bytes_per_token(model) -> int:
    """Key + value bytes one token adds to a DynamicCache: 2 · layers · KV heads · head dim ·
    element size (the cache holds activations, float32 for an int8-quantised model)."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} contain ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_context(total: int, max_context: int) -> None:
    if total > max_context:
        raise InvalidArgument(f"sequence would reach {total} tokens; the model's context is {max_context}")


class Stopwatch:
    """Milliseconds since construction."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self._start) * 1e3
