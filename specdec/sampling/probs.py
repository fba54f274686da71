"""Pure tensor functions that turn logits into the distributions speculative decoding samples.

The draft and the target apply the same processing (temperature, then top-k, then top-p, the
order transformers' `generate` uses), so "the target's distribution" means exactly what
`generate(do_sample=True, ...)` samples from. Greedy (temperature 0) is the limit case: a
one-hot distribution at the argmax, so one rejection rule serves both modes. A request's
logit_bias and penalties come first, on the target only (`biased`, then `penalized`, the order
of transformers' processors): the target's distribution is that of the adjusted logits, and
the draft proposes without them, which its proposals' distributions make exact anyway; only
acceptance pays.

Vocabulary used throughout (as in vLLM's rejection sampler):
- *accepted*: a draft token the target keeps;
- *recovered*: sampled from the residual norm(max(0, target_probs - draft_probs)) after a rejection;
- *bonus*: sampled from the target after all draft tokens were accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from specdec.errors import InvalidArgument
from specdec.sampling.transfer import fetch, to_device

# A residual with less mass than this is treated as empty. It is only sampled after a
# rejection, which then has probability ~0; falling back to target_probs avoids 0/0 = NaN.
RESIDUAL_EPSILON = 1e-12


@dataclass(frozen=True)
class SamplingParams:
    """Request sampling settings; temperature 0 is greedy, top_k 0 and top_p 1.0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # (token id, value added to its logit), ids increasing: the target's distribution is that
    # of its biased logits (`biased`), greedy included. The draft proposes without it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties on tokens already in the sequence (`penalized`), target side as logit_bias:
    # OpenAI's presence and frequency penalties count the generated tokens; transformers'
    # repetition_penalty (1.0 = off) divides the logit of any token in the prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# Below this, logits / temperature overflows float32 to inf and the distributions become NaN;
# such a temperature is greedy in all but ties anyway (vLLM treats < 1e-5 as greedy). Rounded
# to float32 as the request carries it, so a client that sends 1e-5 is accepted.
MIN_TEMPERATURE = float(np.float32(1e-5))
MAX_LOGIT_BIAS = 100.0  # |value| of a logit_bias entry, as OpenAI bounds it
MAX_LOGIT_BIAS_ENTRIES = 300


def check_logit_bias(bias: dict[int, float], name: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """A logit_bias as SamplingParams holds it, ids increasing; InvalidArgument naming `name`
    when it has too many entries, a negative id, or a value that is not finite or too large
    (ids past the vocabulary are the caller's to check: it knows the width)."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"{name} has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}", field=name)
    for token, value in bias.items():
        if token < 0:
            raise InvalidArgument(f"{name} names token {token}; ids are >= 0", field=name)
        if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
            raise InvalidArgument(
                f"{name}[{token}] is {value}; values are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", field=name
            )
    return tuple(sorted((int(token), float(value)) for token, value in bias.items()))


def biased(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits with the request's logit_bias added (as transformers' SequenceBiasLogitsProcessor
    adds a one-token sequence's bias), before temperature, top-k and top-p; unchanged without one.

    logits: [..., V] → [..., V]
    """
    if not params.logit_bias:
        return logits
    ids = to_device(torch.tensor([token for token, _ in params.logit_bias]), logits.device)  # [B]
    values = to_device(torch.tensor([value for _, value in params.logit_bias]), logits.device)  # [B]
    out = logits.float().clone()
    out[..., ids] += values
    return out


MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
# Dividing a logit by a smaller one, then by the least temperature, can overflow float32 to inf
# (1e-40: every row NaN, every draw the last id); 0.01 leaves six orders of magnitude to spare.
MIN_REPETITION_PENALTY = 0.01


def check_penalties(presence: float, frequency: float, repetition: float) -> None:
    """InvalidArgument naming the field out of range (OpenAI's [-2, 2]; repetition in [0.01, 10])."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not (math.isfinite(value) and abs(value) <= MAX_PENALTY):
            raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]; got {value}", field=name)
    if not (math.isfinite(repetition) and MIN_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY):
        raise InvalidArgument(
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off); "
            f"got {repetition}",
            field="repetition_penalty",
        )


def penalized(
    logits: torch.Tensor,  # [R, V]: row i predicts the token after history + draft_ids[:i]
    params: SamplingParams,
    history: Sequence[int],  # [T]: the sequence before the rows' drafts, prompt first
    output_start: int,  # where the generated tokens begin in `history` (the prompt's length)
    draft_ids: Sequence[int] = (),  # [R - 1] at most: the drafts the later rows come after
) -> torch.Tensor:
    """The logits with the request's penalties for what each row's sequence holds:
    repetition_penalty divides a positive logit (multiplies a negative one) of every token in
    it, as transformers' RepetitionPenaltyLogitsProcessor does; then each generated token's
    logit loses presence_penalty once and frequency_penalty per occurrence, as OpenAI and vLLM
    define them. Drafts are generated tokens of the rows after them. Unchanged without penalties.

    → [R, V]
    """
    if not params.penalizes:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    generated = to_device(torch.tensor(list(history[output_start:]), dtype=torch.int64), device)  # [G]
    prompt = to_device(torch.tensor(list(history[:output_start]), dtype=torch.int64), device)  # [P]
    drafts = to_device(torch.tensor(list(draft_ids[: rows - 1]), dtype=torch.int64), device)  # [D]
    counts = torch.zeros(rows, vocab, device=device)  # [R, V]: generated occurrences before each row
    counts += torch.bincount(generated, minlength=vocab)[:vocab].float()
    if len(drafts):
        steps = torch.zeros(rows, vocab, device=device)  # [R, V]: row i + 1 gains draft i
        steps[torch.arange(1, len(drafts) + 1, device=device), drafts] = 1.0
        counts += steps.cumsum(dim=0)
    out = logits.float()
    if params.repetition_penalty != 1.0:
        seen = counts > 0  # [R, V]
        seen[:, prompt] = True
        scaled = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, scaled, out)
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution(s) to sample from; float32.

    logits: [..., V] → probs: [..., V]
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(top_p_dropped(logits, params.top_p), float("-inf"))
    return torch.softmax(logits, dim=-1)


def top_p_dropped(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens transformers' TopPLogitsWarper (min_tokens_to_keep=1) drops, exactly: the
    same ascending sort and the same sum, cumulative from the least likely token, dropping
    while that mass is <= 1 - top_p. Any other order flips boundary tokens (float32 sums
    differ, and ties, common in bf16 logits, break the other way), which changes the
    distribution.

    On a CPU, numpy sorts the values alone (torch's sort with indices took 21 ms a row over
    152k ids, numpy's 1 ms): equal values in any order give the same softmax and the same
    cumulative sums, so the same cut, and a token is dropped iff it lies below the first kept
    value. Only where the cut falls inside a run of equal values does torch's own order say
    which of them go, and there the rows take its order for the same cut.

    logits: [..., V] float32 → [..., V] bool
    """
    if logits.device.type == "cpu":
        sorted_logits = torch.from_numpy(np.sort(logits.numpy(), axis=-1))  # [..., V]
        drop_sorted = _dropped_prefix(sorted_logits, top_p)
        dropped = drop_sorted.sum(dim=-1, keepdim=True)  # [..., 1]
        first_kept = sorted_logits.gather(-1, dropped)  # [..., 1]
        last_dropped = sorted_logits.gather(-1, (dropped - 1).clamp(min=0))  # [..., 1]
        if not ((dropped > 0) & (last_dropped == first_kept)).any():
            return logits < first_kept
        order = torch.sort(logits, descending=False).indices  # [..., V]: the same values, torch's order
    else:
        sorted_logits, order = torch.sort(logits, descending=False)  # [..., V]
        drop_sorted = _dropped_prefix(sorted_logits, top_p)
    return drop_sorted.scatter(-1, order, drop_sorted)


def _dropped_prefix(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] ascending → [..., V] bool: the sorted positions top-p drops, a prefix (the
    cumulative sum never falls)."""
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[..., -1:] = False  # the likeliest token always stays
    return drop_sorted


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): each row's first index of its largest value (of its first NaN where it
    has one), on x's device. x: [..., V] → int64 [...].

    On the CPU through numpy, whose scan is vectorised where torch's CPU argmax is not: over
    151,936 float32 logits on one thread torch took 256 µs and numpy 11, over a verify's
    [5, V] 1.3 ms against 0.09 (Intel Xeon, AVX-512, 2026-12-07). A tensor subclass (one
    that stands for or wraps another device's, as tests/unit/test_device_crossings.py's does)
    keeps torch's own."""
    if type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(np.argmax(x.detach().numpy(), axis=-1))
    return x.argmax(dim=-1)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [..., V] → one-hot float32 [..., V] at the argmax (first index on ties)."""
    return one_hot_at(logits, row_argmax(logits)[..., None])


def one_hot_at(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits: [..., V], rows: [..., 1] indices → one-hot float32 [..., V] at those rows."""
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, rows, 1.0)


def truncate_top_k(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Renormalised top-k of already processed probs; the draft's own optional truncation.

    probs: [..., V] → [..., V]
    """
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs
    kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]  # [..., 1]
    kept = probs.masked_fill(probs < kth, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


class RowSupport(NamedTuple):
    """A row's non-zero entries, on the host: what the wire sends of a sparse row, known without
    reading the row (a [V] row would cross from the device, or be scanned, to find them)."""

    ids: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32: the row's values at `ids`

    @classmethod
    def one_hot(cls, token: int) -> RowSupport:
        """A one-hot row's: probability 1 at `token`."""
        return cls(torch.tensor([token]), torch.ones(1))


def top_k_parts(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`truncate_top_k` of each row, and what names its non-zero entries without scanning the
    row, left on the device for `support_of` once fetched with the step's other outputs (None:
    no truncation). The wire encoder would otherwise look for them in all V entries (0.2 ms a
    row at Qwen's vocabulary on a slow core), and read the row off the device. They are known
    when no entry outside the top k ties the k-th: then everything outside is masked, and the
    support is the top k's ids whose value is above zero.

    probs: [..., V] → ([..., V], [..., 2k + 1]: the top k's ids, the kept row's value at each,
    a tie at the k-th), row by row
    """
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs, None
    top = torch.topk(probs, top_k + 1)  # values descending: [..., k + 1]
    kth, next_value = top.values[..., top_k - 1 : top_k], top.values[..., top_k:]  # [..., 1]
    kept = probs.masked_fill(probs < kth, 0.0)
    # Each row summed alone: a [B, V] sum splits a row over threads otherwise than a [V] one
    # once V passes torch's grain (32,768 on CPU), and rounds apart in the last bit.
    flat = kept.reshape(-1, kept.shape[-1])  # [R, V]
    kept = kept / torch.stack([row.sum() for row in flat]).view(*kept.shape[:-1], 1)  # [..., V]
    ids = top.indices[..., :top_k]  # [..., k]
    tie = (next_value == kth) & (kth > 0)  # [..., 1] a tie at the k-th value keeps more than k entries
    return kept, torch.cat([ids.double(), kept.gather(-1, ids).double(), tie.double()], dim=-1)


def support_of(parts: list[float]) -> RowSupport | None:
    """One row of `top_k_parts`'s parts, fetched (float64, exact for the float32 values): the
    support, ids ascending [k'], or None on a tie (more than k entries kept)."""
    if parts[-1]:
        return None
    top_k = (len(parts) - 1) // 2
    entries = sorted((int(token), value) for token, value in zip(parts[:top_k], parts[top_k:-1]) if value > 0)
    return RowSupport(
        torch.tensor([token for token, _ in entries], dtype=torch.int64),
        torch.tensor([value for _, value in entries], dtype=torch.float32),
    )


def sample(probs: torch.Tensor, generator: np.random.Generator | Sequence[np.random.Generator]) -> torch.Tensor:
    """One token id per row by inverse CDF: token i is drawn when cdf[i-1] <= u < cdf[i], an
    empty interval for a token of probability 0, so those are never drawn. Three times
    cheaper than torch.multinomial over a 152k vocabulary. Rows need not be normalised.
    The uniforms come from a 64-bit numpy generator seeded with the call's whole seed (torch's
    CPU generator would keep only its low 32 bits): one generator's next N draws, or with a
    generator per row (rows of different calls), the next draw of each, the same draw that
    row would take alone.

    probs: [N, V] → token ids [N] (int64)
    """
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()  # [N, 1]
    if isinstance(generator, np.random.Generator):
        drawn = generator.random((probs.shape[0], 1))  # [N, 1]
    else:
        drawn = np.array([each.random((1,))[0] for each in generator])[:, None]  # [N, 1]
    uniforms = to_device(torch.from_numpy(drawn), probs.device)  # [N, 1] float64
    token_ids = torch.searchsorted(cdf, uniforms * total, right=True).squeeze(-1)  # [N]
    # u * total can round up to total itself; it then belongs to the last token whose mass the
    # cdf holds: the first where it reaches its total (a binary search, where a scan of the row
    # for its last nonzero cost three passes over 152k ids, 0.6 ms a row on a CPU). Bounded, so
    # a row of NaNs still gives an id in range, for the caller's finiteness check to name.
    last_with_mass = torch.searchsorted(cdf, total).squeeze(-1).clamp(max=probs.shape[-1] - 1)  # [N]
    return torch.minimum(token_ids, last_with_mass)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)) per row, or target_probs where that is empty.

    target_probs, draft_probs: [K, V] → [K, V]
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)  # [K, 1]
    empty = mass <= RESIDUAL_EPSILON
    return torch.where(empty, target_probs, residual / torch.where(empty, 1.0, mass))


@dataclass(frozen=True)
class VerifyOutputs:
    """What the target hands the coordinator for one round; see VerifyResponse."""

    draft_token_target_probs: torch.Tensor  # [K] float32
    recovered_token_ids: torch.Tensor  # [K] int64
    bonus_token_id: int


@dataclass(frozen=True)
class SparseRows:
    """[K, V] rows by their entries, for the device to build: kilobytes cross to it where the
    dense rows are megabytes (2.4 MB at K = 4 over 151,936 ids; a draft ships its top 256)."""

    flat_ids: torch.Tensor  # [n] int64: row * V + token id, each at most once
    values: torch.Tensor  # [n] float32
    shape: tuple[int, int]  # (K, V)


def rows_on(rows: torch.Tensor | SparseRows, device: torch.device | str) -> torch.Tensor:
    """Draft rows [K, V] as a dense tensor on `device`."""
    if isinstance(rows, torch.Tensor):
        return to_device(rows, device)
    dense = torch.zeros(rows.shape[0] * rows.shape[1], dtype=torch.float32, device=device)  # [K * V]
    dense[to_device(rows.flat_ids, device)] = to_device(rows.values, device)
    return dense.view(rows.shape)


def verify_draws(
    target_probs: torch.Tensor,  # [K + 1, V]
    draft_probs: torch.Tensor,  # [K, V]
    draft_token_ids: torch.Tensor,  # [K] int64
    generator: np.random.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's side of rejection sampling, left on the model's device for the caller to
    fetch with whatever else crosses (one wait): probabilities of the draft tokens [K], a
    recovered sample for every position [K] and the bonus sample [1]. Sampling a recovered
    token at every position (not only the first rejected one) keeps the target independent of
    the coordinator's uniforms, which is what makes the split across processes exact."""
    num_draft = draft_token_ids.shape[0]
    draft_token_target_probs = target_probs[:num_draft].gather(-1, draft_token_ids[:, None]).squeeze(-1)  # [K]
    if num_draft:
        recovered = sample(residual_probs(target_probs[:num_draft], draft_probs), generator)  # [K]
    else:
        recovered = torch.empty(0, dtype=torch.int64, device=target_probs.device)
    return draft_token_target_probs, recovered, sample(target_probs[num_draft:], generator)


def verify_outputs(
    target_probs: torch.Tensor,  # [K + 1, V]
    draft_probs: torch.Tensor,  # [K, V]
    draft_token_ids: torch.Tensor,  # [K] int64
    generator: np.random.Generator,
) -> VerifyOutputs:
    """`verify_draws`, fetched to the host."""
    probs, recovered, bonus = fetch(*verify_draws(target_probs, draft_probs, draft_token_ids, generator))
    return fetched_outputs(probs, recovered, bonus[0])


def fetched_outputs(probs: list[float], recovered: list[float], bonus: float) -> VerifyOutputs:
    """VerifyOutputs from `fetch`'s numbers (float64, exact for float32 and for ids)."""
    return VerifyOutputs(
        torch.tensor(probs, dtype=torch.float32),
        torch.tensor([int(token) for token in recovered], dtype=torch.int64),
        int(bonus),
    )


def argmax_outputs(argmax: torch.Tensor, draft_token_ids: torch.Tensor) -> VerifyOutputs:
    """`verify_outputs` for a one-hot target, without building or sampling one-hots: every
    residual of a one-hot is one-hot at the same argmax. argmax: [K + 1] (CPU), draft_token_ids: [K]."""
    num_draft = draft_token_ids.shape[0]
    return VerifyOutputs((draft_token_ids == argmax[:num_draft]).float(), argmax[:num_draft], int(argmax[num_draft]))
