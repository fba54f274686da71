"""Chat messages become exactly the token ids transformers' own apply_chat_template gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from coordinator.requests import chat_prompt_ids
from specdec.errors import InvalidArgument
from specdec.tools.real_models import TARGET
from specdec.tools.testing import byte_level_tokenizer, word_tokenizer

MODELS_DIR = Path(os.environ.get("SPECDEC_MODELS_DIR", Path(__file__).resolve().parents[2] / ".cache/models"))
CONVERSATIONS = [
    (("user", "Write a palindrome check."),),
    (("system", "You are terse."), ("user", "def add(a, b):")),
    (("system", "S"), ("user", "Hi"), ("assistant", "Hello! ü"), ("user", "And now?")),
]


def expected_ids(tokenizer, messages) -> list[int]:
    conversation = [{"role": role, "content": content} for role, content in messages]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_messages_match_apply_chat_template_token_for_token(messages):
    tokenizer = byte_level_tokenizer()
    assert chat_prompt_ids(messages, tokenizer) == expected_ids(tokenizer, messages)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_real_qwen_template_matches_token_for_token(messages):
    folder = MODELS_DIR / TARGET.name
    if not (folder / "specdec-ready").exists():
        pytest.skip(f"the real pair is not prepared in {MODELS_DIR} (make models)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert chat_prompt_ids(messages, tokenizer) == expected_ids(tokenizer, messages)


def test_unknown_roles_and_missing_templates_are_refused():
    with pytest.raises(InvalidArgument, match="role is 'tool'"):
        chat_prompt_ids((("tool", "x"),), byte_level_tokenizer())
    with pytest.raises(InvalidArgument, match="need a chat template"):
        chat_prompt_ids((("user", "w1"),), word_tokenizer(4))
