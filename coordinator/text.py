"""Turning committed tokens into text: incremental detokenisation, EOS, stop strings, limits.

A round can commit several tokens at once; they are fed here one at a time, so a generation
ends exactly at the token that hits EOS, a stop string or max_new_tokens and nothing past it
is emitted. Streaming text holds back a trailing partial UTF-8 character and any suffix that
could still grow into a stop string.
"""

from __future__ import annotations

import codecs
import weakref
from dataclasses import dataclass, field

from tokenizers import decoders
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


def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte → the byte
    (printable Latin-1 bytes stand for themselves, the others for 256 + n in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {byte: chr(byte) for byte in kept}, 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], extra = chr(256 + extra), extra + 1
    return {char: byte for byte, char in chars.items()}


_BYTE_OF = _byte_of()  # a byte-level token's characters → bytes


class TokenBytes:
    """What each token adds to the text as bytes, for a tokenizer whose decoder is byte-level
    alone (GPT-2's, Qwen's, Llama 3's): the text is then the UTF-8 decoding of every kept token's
    bytes, lossy as the tokenizer's own decoder is, and can be decoded incrementally. None for
    any other tokenizer (`of`)."""

    def __init__(self, backend) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._special = {token_id for token_id, token in added.items() if token.special}  # skip_special_tokens
        self._bytes: dict[int, bytes] = {}  # at most one entry a vocabulary id

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenBytes | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        return cls(backend) if backend is not None and isinstance(backend.decoder, decoders.ByteLevel) else None

    def __call__(self, token_id: int) -> bytes:
        known = self._bytes.get(token_id)
        if known is None:
            token = None if token_id in self._special else self._backend.id_to_token(token_id)
            # As the byte-level decoder: a token all of whose characters stand for bytes is those
            # bytes; any other (an added token's text) is its own UTF-8.
            if token is None:
                known = b""
            elif all(char in _BYTE_OF for char in token):
                known = bytes(_BYTE_OF[char] for char in token)
            else:
                known = token.encode()
            self._bytes[token_id] = known
        return known


class TextAssembler:
    """Incremental detokenisation. With a byte-level tokenizer (`TokenBytes`), each token's
    bytes go through an incremental UTF-8 decoder: constant work a token, a character split
    over tokens held until it is whole, and invalid bytes rendered as the tokenizer renders
    them. With any other, as in TGI: each token decodes only a short window
    (`prefix_offset`..end) and is compared with the window's previous text; that window grows
    while the text ends in an incomplete character, so a run of invalid bytes (a logit_bias
    can force one) would cost time quadratic in its length there."""

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
        self._token_bytes = token_bytes(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
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
        if self._token_bytes is not None:
            new = self._ids[self._read_offset :]
            self._read_offset = len(self._ids)
            return self._utf8.decode(b"".join(self._token_bytes(token) for token in new), final=flush)
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


_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> TokenBytes | None:
    """TokenBytes.of(tokenizer), made once per tokenizer (its cache serves every request)."""
    if tokenizer not in _TOKEN_BYTES:
        _TOKEN_BYTES[tokenizer] = TokenBytes.of(tokenizer)
    return _TOKEN_BYTES[tokenizer]
