"""specdec.engine.tokens: the bytes a token stands for, and the OpenAI API's logprob `bytes`, which
give back text that a token's decoded text alone cannot (a character split over tokens), for
byte-level and SentencePiece vocabularies."""

from __future__ import annotations

import pytest

from coordinator.openai_schema import chat_logprobs
from specdec.engine.tokens import token_bytes
from specdec.tools.testing import byte_level_tokenizer, sentencepiece_tokenizer
from specdec.v1.common_pb2 import TokenLogprobs

TEXT = "naïve café → ok"


def test_a_character_split_over_tokens_comes_back_from_their_bytes():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    split = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    assert split, "the arrow should take several byte tokens, each U+FFFD alone"
    assert b"".join(token_bytes(tokenizer, i) for i in ids).decode() == TEXT
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


def test_chat_logprobs_carry_each_tokens_own_bytes():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    entries = [TokenLogprobs(logprob=-0.5, top_token_ids=[i], top_logprobs=[-0.5]) for i in ids]
    content = chat_logprobs(tokenizer, ids, entries)["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode() == TEXT
    assert [item["top_logprobs"][0]["bytes"] for item in content] == [item["bytes"] for item in content]
    assert any(item["token"] == "\ufffd" and item["bytes"] != list("\ufffd".encode()) for item in content)


@pytest.mark.parametrize("layout", ["llama2", "metaspace"])
def test_sentencepiece_tokens_give_their_spaces_and_fallback_bytes(layout):
    """Llama 2's, Mistral's and Phi-3's tokenizer.json write ▁ in a normalizer and name no
    Metaspace: their `bytes` were once the vocabulary entries' own (▁ as three bytes, <0xE6>
    as six characters), and a token's text lost its leading space (the decoder strips the
    text's first)."""
    tokenizer = sentencepiece_tokenizer(layout)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert any(piece.startswith("<0x") for piece in pieces) and any("▁" in piece for piece in pieces)
    assert b"".join(token_bytes(tokenizer, i) for i in ids).decode() == " " + TEXT  # the ▁ the normalizer put first
    entries = [TokenLogprobs(logprob=-0.5) for _ in ids]
    content = chat_logprobs(tokenizer, ids, entries)["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode() == " " + TEXT
    assert [item["token"] for item in content][:2] == [piece.replace("▁", " ") for piece in pieces[:2]]
