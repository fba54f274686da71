"""Committed tokens → text: partial UTF-8, stop strings across tokens, EOS and length."""

from __future__ import annotations

import random

import pytest

from coordinator.text import TextAssembler, TokenBytes
from specdec.tools.testing import byte_level_tokenizer, word_tokenizer

TEXT = "Résumé: naïve café — 東京 🙂 and SELECT name FROM users;"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def feed(tokenizer, ids, stop=(), max_new_tokens=1000, eos=frozenset()):
    assembler = TextAssembler(tokenizer, tokenizer.encode("Prompt:"), set(eos), tuple(stop), max_new_tokens)
    deltas = []
    for token in ids:
        done = assembler.push(token)
        deltas.append(assembler.take_delta())
        if done:
            break
    return assembler, deltas


def test_streamed_text_equals_full_decode_and_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.split()), "the byte-level tokenizer should split multi-byte characters"
    assembler, deltas = feed(tokenizer, ids)
    assembler.finish("length")
    tail = assembler.take_delta()
    assert "".join(d.text for d in deltas) + tail.text == TEXT
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == ids


def test_stop_string_across_tokens_cuts_text_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode(TEXT)
    assembler, deltas = feed(tokenizer, ids, stop=("café —", "zzz"))
    assert assembler.finish_reason == "stop"
    assert assembler.text == "Résumé: naïve "
    streamed = "".join(d.text for d in deltas)
    assert streamed == "Résumé: naïve "
    assert all("caf" not in "".join(d.text for d in deltas[: i + 1]) for i in range(len(deltas)))
    # The generation ended at the token completing the stop string: nothing after it.
    assert len(assembler.token_ids) < len(ids)


@pytest.mark.parametrize("end", ["length", "eos", "full context"])
def test_a_stop_string_in_the_text_flushed_at_the_end_is_a_stop(tokenizer, end):
    """Text held back as a partial character is searched for stop strings when the generation
    ends and flushes it, as any other text is: it once reached the client with finish_reason
    length or eos."""
    partial = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "c\ufffd")  # "c" + half a char
    ids = [*tokenizer.encode("The big "), partial]
    eos = tokenizer.eos_token_id
    assembler, deltas = feed(
        tokenizer, ids + ([eos] if end == "eos" else []), ("c",), len(ids) if end == "length" else 99, {eos}
    )
    if end == "full context":
        assembler.finish("length")
    text = "".join(d.text for d in deltas) + assembler.take_delta().text
    assert (text, assembler.text, assembler.finish_reason) == ("The big ", "The big ", "stop")


def test_max_new_tokens_and_eos(tokenizer):
    ids = tokenizer.encode(TEXT)
    assembler, _ = feed(tokenizer, ids, max_new_tokens=3)
    assert assembler.finish_reason == "length" and len(assembler.token_ids) == 3
    eos = tokenizer.eos_token_id
    assembler, deltas = feed(tokenizer, ids[:4] + [eos] + ids[4:], eos={eos})
    assert assembler.finish_reason == "eos"
    assert assembler.token_ids == ids[:4] + [eos]
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids[:4])


@pytest.mark.parametrize("make", [byte_level_tokenizer, lambda: word_tokenizer(12)], ids=["byte-level", "words"])
def test_the_fast_decoder_gives_what_decode_gives(make):
    """TextAssembler decodes with a fast tokenizer's backend directly: the same text as
    `decode(skip_special_tokens=True, clean_up_tokenization_spaces=False)` for any ids,
    special ones included (left out of both)."""
    tokenizer = make()
    assembler = TextAssembler(tokenizer, [], set(), (), 10)
    assert assembler._backend is not None
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert assembler._decode(ids) == expected, ids


@pytest.mark.parametrize("make", [byte_level_tokenizer, lambda: word_tokenizer(12)], ids=["byte-level", "words"])
def test_streamed_text_of_any_ids_is_their_decode(make):
    """Token by token, any ids (special ones, bytes that are no UTF-8 at all, characters split
    over tokens) stream to what decode gives for them all."""
    tokenizer = make()
    rng = random.Random(1)
    text_ids = tokenizer.encode(TEXT)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) if rng.random() < 0.5 else rng.choice(text_ids) for _ in range(40)]
        assembler, deltas = feed(tokenizer, ids)
        assembler.finish("length")  # flushes a trailing partial character
        deltas.append(assembler.take_delta())
        expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(delta.text for delta in deltas) == expected, ids


def test_a_run_of_bytes_that_are_no_text_costs_no_decode_of_a_growing_window(monkeypatch):
    """A logit_bias can hold the output on a token that is one byte no character starts with:
    the text then ends in a replacement character after every token, and the window decoded
    for each one grew with the run (8,000 such tokens took 3.6 s of the coordinator's event loop
    with Qwen's tokenizer). A byte-level tokenizer's tokens are decoded as bytes now, never
    through the window."""
    tokenizer = byte_level_tokenizer()
    as_bytes = TokenBytes.of(tokenizer)
    assert as_bytes is not None
    lone = next(t for t in range(len(tokenizer)) if as_bytes(t) == b"\x80")  # a continuation byte alone
    assembler = TextAssembler(tokenizer, [], set(), (), 10_000)
    monkeypatch.setattr(assembler, "_decode", lambda ids: pytest.fail("decoded a window"))
    for _ in range(5000):
        assembler.push(lone)
    assert assembler.take_delta().text == "\ufffd" * 5000
