"""Turning committed tokens into text: incremental detokenisation, EOS, stop strings, limits.

A round can commit several tokens at once; they are fed here one at a time, so a generation
ends exactly at the token that hits EOS, a stop string or max_new_tokens and nothing past it
is emitted. Streaming text holds back a trailing partial UTF-8 character and any suffix that
could still grow into a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from specdec.v1 import common_pb2

# Prompt tokens decoded in front of the output, so tokenizers that drop a leading space
# (SentencePiece) render the first generated token as they would mid-text.
_PROMPT_CONTEXT_TOKENS = 4

FINISH_LENGTH = "length"
FINISH_EOS = "eos"
FINISH_STOP = "stop"


@dataclass
class Delta:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, where asked for


class TextAssembler:
    """Incremental detokenisation as in TGI: each token decodes only a short window
    (`prefix_offset`..end) and is compared with the window's previous text, so the cost per
    token stays constant however long the output grows."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        eos_token_ids: set[int],
        stop: tuple[str, ...],
        max_new_tokens: int,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's own Rust decoder: what `decode` returns without clean-up, minus a
        # layer of Python checks that cost five times the decoding (two decodes per token).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context  # prompt context + generated tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._eos = eos_token_ids
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprobs] = []  # one per token, where the request asked
        self.text = ""  # final text so far (stop string excluded)
        self._emitted_tokens = 0
        self._emitted_chars = 0
        self.finish_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _decode_new(self, flush: bool = False) -> str:
        """Text the tokens since `read_offset` add; "" while they end inside a UTF-8 character."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) > len(prefix_text) and (flush or not window_text.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return window_text[len(prefix_text) :]
        return ""

    def push(self, token_id: int, logprobs: common_pb2.TokenLogprobs | None = None) -> bool:
        """Adds one committed token (with its log-probabilities, where the request asked for
        them); returns True once the generation has finished."""
        if self.finish_reason is not None:
            raise RuntimeError("push after finish")
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self._ids.append(token_id)
        if token_id in self._eos:
            self.finish(FINISH_EOS)
            return True
        new_text = self._decode_new()
        search_from = max(0, len(self.text) - self._longest_stop + 1)  # a stop may start in old text
        self.text += new_text
        if new_text and self._cut_at_stop(search_from):
            return True
        if len(self.token_ids) >= self._max_new_tokens:
            self.finish(FINISH_LENGTH)
            return True
        return False

    def finish(self, reason: str) -> None:
        """Ends the generation (for a reason found outside the tokens, e.g. a full context),
        flushing any trailing partial character as the tokenizer renders it; a stop string in
        what that flushes ends it as a stop."""
        if self.finish_reason is None:
            search_from = max(0, len(self.text) - self._longest_stop + 1)
            self.text += self._decode_new(flush=True)
            if not self._cut_at_stop(search_from):
                self.finish_reason = reason

    def _cut_at_stop(self, search_from: int) -> bool:
        """Ends the generation at the first stop string from `search_from` on, if there is one."""
        positions = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if positions:
            self.text, self.finish_reason = self.text[: min(positions)], FINISH_STOP
        return bool(positions)

    def _held_back(self) -> int:
        """Characters at the end of the text that could still grow into a stop string."""
        if self.finish_reason is not None:
            return 0
        for size in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0

    def take_delta(self) -> Delta:
        """Tokens and text not handed out yet (everything, once finished)."""
        safe_end = max(self._emitted_chars, len(self.text) - self._held_back())
        delta = Delta(
            self.token_ids[self._emitted_tokens :],
            self.text[self._emitted_chars : safe_end],
            self.logprobs[self._emitted_tokens :],
        )
        self._emitted_tokens = len(self.token_ids)
        self._emitted_chars = safe_end
        return delta
