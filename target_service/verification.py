"""A Verify call, runner-side, and what its pass's logits conclude: the draws rejection sampling
needs and whatever else the call asked for (the target's rows, log-probabilities, relaxed
verdicts, features), computed on the model's device and fetched to the host in one transfer
(`specdec.sampling.transfer.fetch_tensors`): on an accelerator one wait a pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.engine.calls import Stopwatch
from specdec.engine.sessions import KVSession
from specdec.sampling.logprobs import PositionLogprobs, position_logprobs
from specdec.sampling.probs import (
    SamplingParams,
    SparseRows,
    biased,
    logits_to_probs,
    penalized,
    row_argmax,
    rows_on,
    verify_draws,
)
from specdec.sampling.relaxed import RelaxedAcceptance, relaxed_verdicts
from specdec.sampling.transfer import fetch_tensors, to_device
from specdec.sampling.tree_sampling import tree_verify_outputs


def never() -> bool:
    """VerifyCall.should_stop's default: a module function, so that a call pickles (the tensor
    parallel runner sends its calls to the other ranks)."""
    return False


@dataclass(frozen=True)
class VerifyCall:
    """One Verify request, runner-side."""

    session_id: str
    keep_tokens: int
    new_tokens: list[int]
    draft_token_ids: list[int]  # [K]
    # [K, V] float32 (CPU) or its entries, from specdec.rpc.wire.decode_distributions; unused on the greedy fast path
    draft_probs: torch.Tensor | SparseRows
    params: SamplingParams
    seed: int
    return_distributions: bool = False
    parents: tuple[int, ...] = ()  # [K]: a token tree (specdec.sampling.tree_sampling numbering); empty: a chain
    cache_namespace: str = ""  # the prefix cache namespace a new session starts in (VerifyRequest)
    relaxed: RelaxedAcceptance | None = None  # VerifyRequest.relaxed: also test each draft (lossy); None exact
    top_logprobs: int | None = None  # VerifyRequest.return_logprobs: its top_logprobs; None: no logprobs
    output_start: int = 0  # VerifyRequest.output_start: where the generated tokens begin (penalties)
    feature_layers: tuple[int, ...] = ()  # VerifyRequest.feature_layers: hidden states to return; empty: none
    should_stop: Callable[[], bool] = never  # polled between a prefill's passes (the caller cancelled)

    @property
    def greedy_fast_path(self) -> bool:
        """Only the target's argmax is needed: greedy, and no rows to return (the draft's rows
        then go unread, and callers need not densify them)."""
        return not needs_draft_probs(self.params, self.return_distributions)


def needs_draft_probs(params: SamplingParams, return_distributions: bool) -> bool:
    """False on the greedy fast path, which only compares draft tokens with the argmax."""
    return not params.greedy or return_distributions


@dataclass(frozen=True)
class Verification:
    draft_token_target_probs: list[float]  # [K]; a tree's: r(d_i) after the node's earlier siblings
    recovered_token_ids: list[int]  # [K]; a tree's: [K + 1], per node (root first) the token after it
    bonus_token_id: int
    target_probs: torch.Tensor | None  # [K + 1, V] when asked for
    processed_tokens: int
    sequence_length: int
    compute_ms: float  # in a batch, the shared pass counts in full for every call in it
    batch_size: int = 1  # sessions that shared the forward pass
    relaxed_accepts: list[bool] = field(default_factory=list)  # [K] with VerifyCall.relaxed; empty otherwise
    logprobs: PositionLogprobs | None = None  # with VerifyCall.top_logprobs
    # With VerifyCall.feature_layers: [processed_tokens, F], the hidden features of each position
    # the call ran (the last processed_tokens of the sequence), in the model's dtype, on the host.
    features: torch.Tensor | None = None


@dataclass
class Admitted:
    """A call whose checks passed and whose session holds its tokens; the pass is next."""

    call: VerifyCall
    session: KVSession
    pending: list[int]  # tokens the cache has not seen: [N]
    clock: Stopwatch
    features: torch.Tensor | None = None  # [N, F] once the pass ran, with VerifyCall.feature_layers

    def verification(self, batch_size: int, **outputs) -> Verification:
        """Its Verification: `outputs`, and what its admission and pass recorded."""
        return Verification(
            processed_tokens=len(self.pending) + (len(self.call.draft_token_ids) if self.call.parents else 0),
            sequence_length=len(self.session.tokens),
            compute_ms=self.clock.ms(),
            batch_size=batch_size,
            **outputs,
        )


LOGPROB_PARTS = ("logprob_draft", "logprob_rows", "logprob_top_ids", "logprob_top")  # position_logprobs' tensors


def fetched_logprobs(got: dict[str, torch.Tensor]) -> PositionLogprobs | None:
    """The log-probabilities among a call's fetched tensors, if it asked for them."""
    return PositionLogprobs.of([got[name] for name in LOGPROB_PARTS]) if LOGPROB_PARTS[0] in got else None


def next_step(first: VerifyCall, last: Verification, seed: int) -> VerifyCall:
    """A target-only step after `last` (VerifyRequest.step_seeds): `first` feeding the token
    `last` drew, drawing the next with `seed`."""
    return dataclasses.replace(first, keep_tokens=last.sequence_length, new_tokens=[last.bonus_token_id], seed=seed)


def fetch_outputs(
    call: VerifyCall,
    logits: torch.Tensor,  # [R, V]
    probs: torch.Tensor,  # [K]: each draft's (a tree node's) target probability, as drawn
    row_ids: torch.Tensor,  # [R]: the token each position emits if the round ends there
    target_probs: torch.Tensor | None,  # [R, V]
    draft_rows: torch.Tensor,  # [K]: the position predicting each draft (a tree node's parent)
    draft_ids: torch.Tensor,  # [K]
    relaxed: torch.Tensor | None = None,  # [K] bool
    features: torch.Tensor | None = None,  # [N, F]
) -> dict[str, torch.Tensor]:
    """A call's outputs, the logits' sum and what else it asked for, on the host in one transfer."""
    logprobs = (
        ()
        if call.top_logprobs is None
        else position_logprobs(logits, draft_rows, draft_ids, row_ids, call.top_logprobs)
    )
    return fetch_tensors(
        total=logits.sum(),
        probs=probs,
        row_ids=row_ids,
        target_probs=target_probs if call.return_distributions else None,
        relaxed=relaxed,
        features=features,
        **dict(zip(LOGPROB_PARTS, logprobs)),
    )


def conclude_chain(admitted: Admitted, logits: torch.Tensor, batch_size: int) -> tuple[Verification, float]:
    """A chain round's outputs from the K + 1 positions that predict a draft token or the
    bonus, and the logits' sum (for the caller's finiteness check, fetched with them).

    logits: [K + 1, V]
    """
    call, device = admitted.call, logits.device
    num_draft = len(call.draft_token_ids)
    draft_ids = to_device(torch.tensor(call.draft_token_ids, dtype=torch.int64), device)  # [K]
    # [K + 1, V]: the logits the distribution is of: logit_bias, then penalties, as
    # transformers orders its SequenceBias and RepetitionPenalty processors.
    scored = biased(logits, call.params)
    if call.params.penalizes:
        tokens = admitted.session.tokens
        history = tokens[: len(tokens) - num_draft]
        scored = penalized(scored, call.params, history, call.output_start, call.draft_token_ids)
    target_probs = None
    if call.greedy_fast_path:  # a one-hot target: a draft is accepted iff it is the argmax
        heads = row_argmax(scored)  # [K + 1]
        probs, recovered, bonus = (draft_ids == heads[:num_draft]).float(), heads[:num_draft], heads[num_draft:]
    else:  # the uniforms come from the seed's stream on the host; a NaN row still draws ids in range
        target_probs = logits_to_probs(scored, call.params)  # [K + 1, V]
        generator = np.random.default_rng(call.seed)
        probs, recovered, bonus = verify_draws(target_probs, rows_on(call.draft_probs, device), draft_ids, generator)
    row_ids = torch.cat([recovered, bonus])  # [K + 1]: the token each position emits if the round ends there
    relaxed = None if call.relaxed is None else relaxed_verdicts(call.relaxed, call.params, scored, draft_ids, probs)
    draft_rows = torch.arange(num_draft, device=device)  # [K]: the position predicting each draft
    got = fetch_outputs(call, logits, probs, row_ids, target_probs, draft_rows, draft_ids, relaxed, admitted.features)
    ids = got["row_ids"].tolist()
    return admitted.verification(
        batch_size,
        draft_token_target_probs=got["probs"].tolist(),
        recovered_token_ids=ids[:num_draft],
        bonus_token_id=ids[num_draft],
        target_probs=got.get("target_probs"),
        relaxed_accepts=got["relaxed"].tolist() if "relaxed" in got else [],
        logprobs=fetched_logprobs(got),
        features=got.get("features"),
    ), got["total"].item()


def conclude_tree(admitted: Admitted, logits: torch.Tensor, batch_size: int) -> tuple[Verification, float]:
    """A tree round's outputs (specdec.sampling.tree_sampling), and the logits' sum, fetched
    with them. logits: [N + 1, V], root first."""
    call, device = admitted.call, logits.device
    parents = to_device(torch.tensor(call.parents, dtype=torch.int64), device)  # [N]
    draft_ids = torch.tensor(call.draft_token_ids, dtype=torch.int64)  # [N], on the host (tree_verify_outputs)
    on_device = to_device(draft_ids, device)  # [N]
    scored, target_probs = biased(logits, call.params), None  # [N + 1, V]
    if call.greedy_fast_path:
        # A one-hot target: a node is accepted iff it is its parent's argmax, and every
        # residual of a one-hot is one-hot at the same argmax.
        next_ids = row_argmax(scored)  # [N + 1]
        node_probs = (on_device == next_ids[parents]).float()  # [N]
    else:
        target_probs, generator = logits_to_probs(scored, call.params), np.random.default_rng(call.seed)
        drawn = tree_verify_outputs(target_probs, call.draft_probs, draft_ids, call.parents, generator)
        node_probs, next_ids = drawn.node_target_probs, drawn.next_token_ids
    got = fetch_outputs(call, logits, node_probs, next_ids, target_probs, parents, on_device)
    return admitted.verification(
        batch_size,
        draft_token_target_probs=got["probs"].tolist(),
        recovered_token_ids=got["row_ids"].tolist(),
        bonus_token_id=0,
        target_probs=got.get("target_probs"),
        logprobs=fetched_logprobs(got),
    ), got["total"].item()
