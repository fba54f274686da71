"""Turning committed tokens into text: incremental detokenisation, EOS, stop strings, limits.

A round can commit several tokens at once; they are fed here one at a time, so a generation
ends exactly at the token that hits EOS, a stop string or max_new_tokens and nothing past it
is emitted. Streaming text holds back a trailing partial UTF-8 character and any suffix that
could still grow into a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

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


class TextAssembler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        eos_token_ids: set[int],
        stop: tuple[str, ...],
        max_new_tokens: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._context_text = self._decode(self._context)
        self._eos = eos_token_ids
        self._stop = stop
        self._max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""  # final text so far (stop string excluded)
        self._emitted_tokens = 0
        self._emitted_chars = 0
        self.finish_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> bool:
        """Adds one committed token; returns True once the generation has finished."""
        if self.finish_reason is not None:
            raise RuntimeError("push after finish")
        self.token_ids.append(token_id)
        if token_id in self._eos:
            self.finish_reason = FINISH_EOS
            return True
        full = self._decode(self._context + self.token_ids)
        self.text = full[len(self._context_text) :] if full.startswith(self._context_text) else self._decode(self.token_ids)
        if self._stop:
            cut = self._first_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason = FINISH_STOP
                return True
        if len(self.token_ids) >= self._max_new_tokens:
            self.finish_reason = FINISH_LENGTH
            return True
        return False

    def finish(self, reason: str) -> None:
        """Ends the generation for a reason found outside the tokens (e.g. the context is full)."""
        self.finish_reason = self.finish_reason or reason

    def _first_stop(self) -> int | None:
        positions = [i for i in (self.text.find(s) for s in self._stop) if i >= 0]
        return min(positions) if positions else None

    def _held_back(self) -> int:
        """Characters at the end of the text that must not be streamed yet."""
        if self.finish_reason is not None:
            return 0
        held = 0
        if self.text.endswith("\ufffd"):  # a multi-byte character split across tokens
            held = len(self.text) - len(self.text.rstrip("\ufffd"))
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def take_delta(self) -> Delta:
        """Tokens and text not handed out yet (everything, once finished)."""
        safe_end = max(self._emitted_chars, len(self.text) - self._held_back())
        delta = Delta(self.token_ids[self._emitted_tokens :], self.text[self._emitted_chars : safe_end])
        self._emitted_tokens = len(self.token_ids)
        self._emitted_chars = safe_end
        return delta
