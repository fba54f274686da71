"""The bytes a token stands for, whatever form its tokenizer writes its vocabulary in: byte-level
BPE (GPT-2's printable alphabet: Qwen, Llama 3, SmolLM), SentencePiece (▁ for a space, <0xNN>
byte fallback) or plain text. A token may end inside a UTF-8 character, so its decoded text
(U+FFFD there) does not give its bytes back; the vocabulary entry does. The draft's vocabulary
bridge compares tokens by them; the OpenAI API returns them as a logprob's `bytes`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (as Qwen, Llama 3
    and SmolLM write their vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _spec(tokenizer: PreTrainedTokenizerBase) -> dict:
    """The fast tokenizer's tokenizer.json; {} for a slow one."""
    try:
        return json.loads(tokenizer.backend_tokenizer.to_str())
    except (AttributeError, ValueError):
        return {}


def _component_types(spec: dict) -> set[str]:
    """The types of a tokenizer's pre-tokenizer and decoder, nested ones included."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec.get("pre_tokenizer"))
    walk(spec.get("decoder"))
    return found


class TokenForm:
    """How one tokenizer writes bytes in its vocabulary: byte-level (GPT-2 alphabet),
    SentencePiece (▁ for a space, <0xNN> bytes) or plain text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        spec = _spec(tokenizer)
        types = _component_types(spec)
        self.tokenizer = tokenizer
        self.byte_level = "ByteLevel" in types
        # SentencePiece: Metaspace, or in Llama 2's, Mistral's and Phi-3's tokenizer.json a
        # normalizer that writes ▁ for a space and a decoder with byte fallback.
        spaces = "▁" in json.dumps(spec.get("normalizer"), ensure_ascii=False)
        self.metaspace = not self.byte_level and ("Metaspace" in types or "ByteFallback" in types or spaces)
        self._decode_byte = {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(self, token: str) -> bytes:
        """The bytes a vocabulary entry stands for."""
        if self.byte_level and all(char in self._decode_byte for char in token):
            return bytes(self._decode_byte[char] for char in token)
        if self.metaspace:
            if match := _BYTE_TOKEN.match(token):
                return bytes([int(match.group(1), 16)])
            return token.replace("▁", " ").encode()
        return token.encode()

    def encode_bytes(self, data: bytes) -> list[int]:
        """Ids that spell `data` in this vocabulary, without pre-tokenisation or special tokens."""
        model = self.tokenizer.backend_tokenizer.model
        if self.byte_level:
            text = "".join(bytes_to_unicode()[byte] for byte in data)
            return [token.id for token in model.tokenize(text)]
        text = data.decode("utf-8", errors="replace")
        if self.metaspace:
            return [token.id for token in model.tokenize(text.replace(" ", "▁"))]
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@lru_cache(maxsize=8)
def token_form(tokenizer: PreTrainedTokenizerBase) -> TokenForm:
    """The tokenizer's TokenForm, built once (it reads the whole tokenizer's JSON)."""
    return TokenForm(tokenizer)


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The bytes token `token_id` stands for in text: an added or special token's own text, else
    its vocabulary entry's bytes (a token ending inside a UTF-8 character gives that part)."""
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is not None:
        return added.content.encode()
    return token_form(tokenizer).token_bytes(str(tokenizer.convert_ids_to_tokens(token_id)))
