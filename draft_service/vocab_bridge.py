"""Token-level intersection (TLI): a draft model with another tokenizer drafts for a target.

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025, arXiv 2502.05202); vLLM's `use_heterogeneous_vocab`.

The draft service speaks the target's ids on the wire (its *caller's* ids) and its own inside:
- **Context in.** Each caller token becomes draft tokens: itself where both vocabularies hold
  the same bytes (the *shared* tokens), else its bytes re-tokenised by the draft's tokenizer.
  Token by token, so a sequence's draft form is a function of its prefix: a kept prefix of
  the caller's keeps a prefix of the draft's, and the KV cache rolls back as it always does.
  (The draft then reads, say, "ĠĠĠĠĠĠĠĠ" as two 4-space tokens where its own tokenizer
  would have used one 8-space token: only its predictions, never exactness, depend on that.)
- **Proposals out.** The draft's output head is cut to the shared tokens
  (`modeling.restrict_output_head`), so its distribution is renormalised over them, and
  every proposed token maps to exactly one caller id. The distribution ships over the
  caller's ids, zero outside the shared ones.

Why the output stays exactly the target's: speculative sampling accepts a token drawn from any
distribution q with probability min(1, p/q) and otherwise samples norm(max(0, p - q)), and
the result is distributed as p for every q whose support lies inside the target's vocabulary,
as long as q is the distribution the token was drawn from, given the same prefix. Here q is
the draft's distribution renormalised over the shared tokens, shipped with the token and
mapped to the target's ids, and what context produced it never enters the argument. The
target's distribution is untouched. Tokens the draft cannot propose (outside the
intersection) are still emitted: the target samples them as recovered or bonus tokens.

Tokens compare by the bytes they stand for (byte-level BPE and SentencePiece forms decoded),
special tokens by their text and only with special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from specdec.engine.tokens import TokenForm
from specdec.errors import InvalidArgument


def vocabulary_keys(tokenizer: PreTrainedTokenizerBase) -> dict[tuple[bool, bytes], int]:
    """(special, bytes) → the lowest id with that key, over the tokenizer's whole vocabulary."""
    form = TokenForm(tokenizer)
    special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    keys: dict[tuple[bool, bytes], int] = {}
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if token in special:
            key = (True, token.encode())
        elif token in added:  # an added normal token is written as text, not in the byte alphabet
            key = (False, token.encode())
        else:
            key = (False, form.token_bytes(token))
        keys.setdefault(key, token_id)
    return keys


@dataclass(frozen=True)
class BridgeFigures:
    """ModelInfo.vocab_bridge: what the coordinator logs and checks."""

    draft_model_id: str
    draft_tokenizer_fingerprint: str
    shared_tokens: int
    caller_vocab_tokens: int  # the caller tokenizer's length (its model may have more logit columns)
    proposable: bytes  # bit i (little-endian within each byte) set: caller id i may be proposed

    @property
    def share(self) -> float:
        return self.shared_tokens / max(1, self.caller_vocab_tokens)


class VocabBridge:
    """The id maps between a caller's vocabulary (the target's) and the draft's own. Every
    caller id below the caller model's logit width has a draft form (ids past its tokenizer's
    length, which name no text, the draft's unknown or EOS token)."""

    def __init__(self, draft, caller):
        """`draft`: the draft's LoadedModel; `caller`: the target's TokenizerInfo
        (specdec.engine.modeling); both give tokenizer, vocab_size, model_id,
        tokenizer_fingerprint and eos_token_ids."""
        draft_tokenizer, caller_tokenizer = draft.tokenizer, caller.tokenizer
        caller_vocab_size, draft_vocab_size = caller.vocab_size, draft.vocab_size
        self.caller = caller
        self.caller_vocab_size = caller_vocab_size
        self.caller_tokens = len(caller_tokenizer)
        self._draft_form = TokenForm(draft_tokenizer)
        draft_keys = {key: i for key, i in vocabulary_keys(draft_tokenizer).items() if i < draft_vocab_size}
        caller_keys = vocabulary_keys(caller_tokenizer)
        self._caller_key = {i: key for key, i in caller_keys.items()}
        pairs = sorted((draft_keys[key], caller_id) for key, caller_id in caller_keys.items() if key in draft_keys)
        if not pairs:
            raise ValueError("the draft's and the target's vocabularies share no token")
        # The draft's head rows, ascending by draft id, and the caller id each row proposes.
        self.draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)  # [S]
        self.caller_ids = torch.tensor([c for _, c in pairs], dtype=torch.long)  # [S]
        self._to_caller = dict(pairs)  # draft id → caller id, shared tokens only
        self._to_draft = {c: d for d, c in pairs}
        fallback = draft_tokenizer.unk_token_id
        if fallback is None:
            fallback = draft_tokenizer.eos_token_id if draft_tokenizer.eos_token_id is not None else 0
        self._fallback = int(fallback)
        self._spelled: dict[int, tuple[int, ...]] = {}
        bits = np.zeros(caller_vocab_size, dtype=bool)
        bits[self.caller_ids.numpy()] = True
        proposable = np.packbits(bits, bitorder="little").tobytes()
        self.figures = BridgeFigures(
            draft.model_id, draft.tokenizer_fingerprint, len(pairs), self.caller_tokens, proposable
        )

    def draft_form(self, caller_id: int) -> tuple[int, ...]:
        """The draft tokens a caller token becomes: one when shared, else its bytes re-tokenised
        by the draft (at least one token, so every caller position has a draft position)."""
        shared = self._to_draft.get(caller_id)
        if shared is not None:
            return (shared,)
        spelled = self._spelled.get(caller_id)
        if spelled is None:
            key = self._caller_key.get(caller_id)
            ids = self._draft_form.encode_bytes(key[1]) if key is not None and key[1] else []
            spelled = tuple(ids) or (self._fallback,)
            self._spelled[caller_id] = spelled
        return spelled

    def to_draft(self, caller_tokens: list[int], start: int) -> tuple[list[int], list[int]]:
        """`caller_tokens` as draft tokens, and the draft length after each of them when the
        draft sequence before them is `start` long: ([M] draft ids, [N] positions)."""
        draft: list[int] = []
        positions: list[int] = []
        for index, token in enumerate(caller_tokens):
            if not 0 <= token < self.caller_vocab_size:
                raise InvalidArgument(
                    f"new_tokens[{index}] = {token} is outside the target's vocabulary [0, {self.caller_vocab_size})"
                )
            draft.extend(self.draft_form(token))
            positions.append(start + len(draft))
        return draft, positions

    def to_caller(self, draft_id: int) -> int | None:
        """The caller id of a shared draft token; None for any other."""
        return self._to_caller.get(draft_id)
