"""Protobuf ↔ tensor conversion for proposal distributions, shared by servicers and coordinator.

A proposal distribution travels in the smallest exact form: a marker for one-hot proposals,
(id, prob) pairs for truncated ones and raw little-endian float32 for full ones. All three
decode to the same float32 values the draft sampled from, so the residual is exact.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.engine.calls import ModelDescription
from specdec.engine.features import FEATURE_DTYPES
from specdec.errors import InvalidArgument
from specdec.sampling.logprobs import PositionLogprobs, check_top_logprobs
from specdec.sampling.probs import (
    MIN_TEMPERATURE,
    RowSupport,
    SamplingParams,
    SparseRows,
    check_logit_bias,
    check_penalties,
)
from specdec.sampling.relaxed import RelaxedAcceptance, check_relaxed
from specdec.v1 import common_pb2, target_pb2

# Sparse costs 8 bytes per non-zero entry and dense 4 per vocab entry.
_SPARSE_MAX_FRACTION = 0.5
# Protocol limits both sides read: VerifyRequest.step_seeds, ProposeBranchesRequest.end_session_ids,
# ProposeRequest.runner_ups and guess_rank, ProposeBranchesRequest.branches.
MAX_STEP_SEEDS = 64
MAX_ENDED_SESSIONS = 64
MAX_RUNNER_UPS = 4
MAX_BRANCHES = 32
# How far a draft row's mass may stray from 1: float32 rounding of a softmax over 152k ids
# stays under 1e-5; a row this far off was not normalised.
ROW_MASS_TOLERANCE = 1e-3


def encode_distributions(
    probs: torch.Tensor | None,
    count: int,
    deterministic: bool,
    supports: list[RowSupport | None] | None = None,
) -> list[common_pb2.ProposalDistribution]:
    """probs: [count, V], or None when deterministic (one-hot rows need no values). Each row
    travels sparse when at most half its entries are non-zero, dense otherwise. `supports`:
    per row, exactly its non-zero entries where the drafter knows them, on the host
    (probs.top_k_parts): when every row's are known, the rows themselves are not read
    (on an accelerator they stay there)."""
    if deterministic:
        return [common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot()) for _ in range(count)]
    if probs is None:
        raise ValueError("a sampled proposal must carry the distributions its tokens were drawn from")
    if (
        supports is not None
        and len(supports) == count
        # The scan's rule too: a row with more than this many entries goes dense.
        and all(row is not None and len(row.ids) <= _SPARSE_MAX_FRACTION * probs.shape[-1] for row in supports)
    ):
        return [
            common_pb2.ProposalDistribution(sparse=packed_sparse(row.ids.numpy(), row.values.numpy()))
            for row in supports
            if row is not None  # all are: for the type checker
        ]
    rows = probs.detach().to("cpu", torch.float32).numpy()  # [count, V]
    # One scan of the whole [count, V] array counts every row's support; only the rows that go
    # sparse are read out (on Qwen's vocabulary four dense rows took 46 ms through torch's
    # nonzero and a list of every value, 0.7 ms this way, one core of the AMD EPYC).
    nonzero = rows != 0  # [count, V]
    sizes = np.count_nonzero(nonzero, axis=1).tolist()  # [count]
    out = []
    for row, size in enumerate(sizes):
        if size <= _SPARSE_MAX_FRACTION * rows.shape[1]:
            ids = np.flatnonzero(nonzero[row])  # [size]
            out.append(common_pb2.ProposalDistribution(sparse=packed_sparse(ids, rows[row, ids])))
        else:
            out.append(common_pb2.ProposalDistribution(dense=_dense_bytes(rows[row])))
    return out


def packed_sparse(ids: np.ndarray, values: np.ndarray) -> common_pb2.SparseProbs:
    """ids: [n] integer, values: [n] float → SparseProbs in its packed form (little-endian
    int32 and float32). Four rows of 256 entries cost a tenth of the repeated fields' building
    (and their reading and forwarding less still): the three processes' CPU per sampled round."""
    return common_pb2.SparseProbs(token_ids_le=ids.astype("<i4").tobytes(), probs_le=values.astype("<f4").tobytes())


def sparse_entries(sparse: common_pb2.SparseProbs, row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SparseProbs in either form → ([n] int64 ids, [n] float32 values), their lengths checked."""
    if sparse.token_ids_le or sparse.probs_le:
        if sparse.token_ids or sparse.probs:
            raise InvalidArgument(f"sparse distribution {row} is both packed and repeated; send one form")
        if len(sparse.token_ids_le) % 4 or len(sparse.probs_le) % 4:
            raise InvalidArgument(
                f"sparse distribution {row} has {len(sparse.token_ids_le)} bytes of ids and {len(sparse.probs_le)} "
                "of probs; each must be a multiple of 4"
            )
        ids = np.frombuffer(sparse.token_ids_le, dtype="<i4").astype(np.int64)
        values = np.frombuffer(sparse.probs_le, dtype="<f4")
    else:
        ids = np.asarray(sparse.token_ids, dtype=np.int64)
        values = np.asarray(sparse.probs, dtype=np.float32)
    if ids.shape != values.shape:
        raise InvalidArgument(
            f"sparse distribution {row} has {ids.size} ids but {values.size} probs; they must pair up"
        )
    return ids, values


def _dense_bytes(row: np.ndarray) -> common_pb2.DenseProbs:
    """row: [V] float32 → DenseProbs (little-endian float32)."""
    return common_pb2.DenseProbs(float32_le=row.astype("<f4").tobytes())


def encode_dense(probs: torch.Tensor) -> common_pb2.DenseProbs:
    """probs: [V] → DenseProbs (little-endian float32)."""
    return _dense_bytes(probs.detach().to("cpu", torch.float32).numpy())


def decode_dense(dense: common_pb2.DenseProbs) -> np.ndarray:
    """DenseProbs → [V] float32 (read-only view of the message bytes)."""
    if len(dense.float32_le) % 4:
        raise InvalidArgument(f"dense distribution has {len(dense.float32_le)} bytes; expected a multiple of 4")
    return np.frombuffer(dense.float32_le, dtype="<f4")


def decode_distributions(
    distributions: list[common_pb2.ProposalDistribution],
    token_ids: list[int],
    vocab_size: int,
) -> torch.Tensor | SparseRows:
    """Draft distributions as [K, vocab_size] float32 rows over the target's vocab: by their
    entries (SparseRows, which the target builds on its device) unless a row came dense.

    A draft with fewer logit columns sends narrower rows, which are zero-padded. A draft with
    more is told the target's width (ProposeRequest.vocab_limit) and gives the ids past it
    probability 0; mass a draft put there anyway is dropped, which leaves the residual
    norm(max(0, target_probs - draft_probs)) unchanged, as the target gives those ids 0 (the
    coordinator refuses a proposed token past the target's width outright).
    """
    if len(distributions) != len(token_ids):
        raise InvalidArgument(
            f"got {len(token_ids)} draft tokens but {len(distributions)} distributions; one per token is required"
        )
    rows: list[tuple[np.ndarray, np.ndarray] | np.ndarray] = []  # per row: (ids, values), or dense values
    for row, (dist, token_id) in enumerate(zip(distributions, token_ids)):
        kind = dist.WhichOneof("kind")
        if kind == "one_hot":
            kept = [token_id] if 0 <= token_id < vocab_size else []
            rows.append((np.array(kept, np.int64), np.ones(len(kept), np.float32)))
        elif kind == "sparse":
            ids, values = sparse_entries(dist.sparse, row)
            _check_row(row, values)
            if ids.size and ids.min() < 0:
                raise InvalidArgument(f"sparse distribution {row} names a negative token id")
            inside = ids < vocab_size
            # An id named twice: with two values the dense row held the last and the
            # coordinator's acceptance test (token_probability) reads the first; with one, the
            # row counted it twice toward its mass. (8 us for 256 ids on the AMD EPYC.)
            if ids.size > 1 and not np.diff(np.sort(ids)).all():
                raise InvalidArgument(f"sparse distribution {row} names a token id twice")
            rows.append((ids[inside], values[inside]))
        elif kind == "dense":
            values = decode_dense(dist.dense)
            _check_row(row, values)
            rows.append(values[:vocab_size])
        else:
            raise InvalidArgument(f"distribution {row} is empty; set one_hot, sparse or dense")
    if all(isinstance(entries, tuple) for entries in rows):
        flat_ids = [ids + row * vocab_size for row, (ids, _) in enumerate(rows)]
        return SparseRows(
            torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *flat_ids])),
            torch.from_numpy(np.concatenate([np.zeros(0, np.float32), *(values for _, values in rows)])),
            (len(rows), vocab_size),
        )
    draft_probs = np.zeros((len(token_ids), vocab_size), dtype=np.float32)  # [K, V]
    for row, entries in enumerate(rows):
        if isinstance(entries, tuple):
            draft_probs[row, entries[0]] = entries[1]
        else:
            draft_probs[row, : entries.size] = entries
    return torch.from_numpy(draft_probs)  # numpy's indexing: a tenth of torch's per-op cost on short rows


def _check_row(row: int, values: np.ndarray) -> None:
    """Checks only the values a message carries (scanning the whole [K, V] tensor instead cost
    milliseconds per call at Qwen's vocabulary): finite and non-negative, and their mass, past
    the target's width included, 1 to float32 rounding. Rejection sampling is exact only for the
    distribution the token was drawn from, and a row scaled by c (a drafter that forgot to
    normalise) would accept each draft with min(1, p/(cq)) and leave the wrong residual, a bias
    no other check sees."""
    if values.size and not (np.isfinite(values).all() and values.min() >= 0):
        raise InvalidArgument("draft distributions must hold finite, non-negative probabilities")
    mass = float(values.sum())  # [V] -> []: pairwise in float32, ~1e-6 off at Qwen's width
    if not abs(mass - 1.0) <= ROW_MASS_TOLERANCE:
        raise InvalidArgument(
            f"draft distribution {row} sums to {mass:.6g}, not 1: not the distribution its token was drawn from"
        )


def token_probability(distribution: common_pb2.ProposalDistribution, token_id: int) -> float:
    """The probability a proposal distribution gives `token_id`, without densifying it."""
    kind = distribution.WhichOneof("kind")
    if kind == "one_hot":
        return 1.0
    if kind == "sparse":
        ids, values = sparse_entries(distribution.sparse)
        hits = np.flatnonzero(ids == token_id)  # the first, as decode_distributions refuses a repeat
        return float(values[hits[0]]) if hits.size else 0.0
    if kind == "dense":
        values = decode_dense(distribution.dense)
        return float(values[token_id]) if 0 <= token_id < values.size else 0.0
    raise InvalidArgument("proposal distribution is empty; set one_hot, sparse or dense")


def params_from_pb(sampling: common_pb2.SamplingParams) -> SamplingParams:
    """Validates internal sampling settings; the coordinator has already checked the request."""
    temperature = sampling.temperature
    if not math.isfinite(temperature) or not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise InvalidArgument(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}; got {temperature}"
        )
    if sampling.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 = off); got {sampling.top_k}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1] (1.0 = off); got {sampling.top_p}")
    repetition = sampling.repetition_penalty or 1.0  # unset: off
    check_penalties(sampling.presence_penalty, sampling.frequency_penalty, repetition)
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        # The wire's float32, back to the number the caller wrote (0.9, not 0.89999998): the cut
        # at 1 - top_p is then transformers' to the last bit (1 - float32(0.9) rounds 3 ulps off).
        top_p=float(str(np.float32(sampling.top_p))),
        logit_bias=check_logit_bias(dict(sampling.logit_bias)),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=repetition,
    )


def params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        logit_bias=dict(params.logit_bias),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )


def relaxed_from_pb(request: target_pb2.VerifyRequest) -> RelaxedAcceptance | None:
    """VerifyRequest.relaxed, validated; None (exact) when unset."""
    if not request.HasField("relaxed"):
        return None
    return check_relaxed(request.relaxed.top_n, request.relaxed.delta, "relaxed.top_n", "relaxed.delta")


def relaxed_to_pb(relaxed: RelaxedAcceptance) -> target_pb2.RelaxedAcceptance:
    return target_pb2.RelaxedAcceptance(top_n=relaxed.top_n, delta=relaxed.delta)


def top_logprobs_from_pb(request: target_pb2.VerifyRequest) -> int | None:
    """VerifyRequest.return_logprobs as VerifyCall.top_logprobs (None: no logprobs), validated."""
    return check_top_logprobs(request.top_logprobs, request.return_logprobs, "return_logprobs")


def token_logprobs_to_pb(logprobs: PositionLogprobs | None) -> list[common_pb2.TokenLogprobs]:
    """One TokenLogprobs per position (VerifyResponse.row_logprobs); [] without logprobs."""
    if logprobs is None:
        return []
    return [
        common_pb2.TokenLogprobs(logprob=own, top_token_ids=ids, top_logprobs=top)
        for own, ids, top in zip(logprobs.rows, logprobs.top_ids, logprobs.top, strict=True)
    ]


def description_to_pb(description: ModelDescription) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=description.model_id,
        vocab_size=description.vocab_size,
        tokenizer_fingerprint=description.tokenizer_fingerprint,
        eos_token_ids=list(description.eos_token_ids),
        max_context=description.max_context,
        dtype=description.dtype,
        device=description.device,
        open_sessions=description.open_sessions,
        fork_sessions=description.fork_sessions,
        max_sessions=description.max_sessions,
        max_speculative_tokens=description.max_speculative_tokens,
        kv_cache_bytes=description.kv_cache_bytes,
        max_kv_cache_bytes=description.max_kv_cache_bytes,
        kv_bytes_per_token=description.kv_bytes_per_token,
        evicted_sessions=description.evicted_sessions,
        tensor_parallel_size=description.tensor_parallel_size,
        calibrated_pass_ms=list(description.calibrated_pass_ms),
        live_pass_ms=list(description.live_pass_ms),
        cost_context_tokens=description.cost_context_tokens,
        copies=description.copies,
        trees=description.trees,
        quantization=description.quantization,
        weights_fingerprint=description.weights_fingerprint,
        device_kind=description.device_kind,
        feature_layers=list(description.feature_layers),
        feature_target_fingerprint=description.feature_target_fingerprint,
        checkpoint_fingerprint=description.checkpoint_fingerprint,
        feature_target_checkpoint=description.feature_target_checkpoint,
        pass_cost_profile=description.pass_cost_profile,
        static_passes=description.static_passes,
        emulation_overruns=description.emulation_overruns,
        calibrated_batch_ms=[
            common_pb2.BatchCost(sessions=sessions, new_tokens=new_tokens, ms=ms)
            for sessions, new_tokens, ms in description.calibrated_batch_ms
        ],
        max_batch_size=description.max_batch_size,
        prefix_cache=common_pb2.PrefixCacheInfo(
            **dict(
                zip(("bytes", "max_bytes", "block_tokens", "lookups", "hits", "tokens_saved"), description.prefix_cache)
            )
        ),
        vocab_bridge=_bridge_to_pb(description.vocab_bridge),
        host_id=description.host_id,
        cpus=list(description.cpus),
    )


def _bridge_to_pb(figures) -> common_pb2.VocabBridgeInfo | None:
    if figures is None:
        return None
    return common_pb2.VocabBridgeInfo(
        draft_model_id=figures.draft_model_id,
        draft_tokenizer_fingerprint=figures.draft_tokenizer_fingerprint,
        shared_tokens=figures.shared_tokens,
        target_vocab_tokens=figures.caller_vocab_tokens,
        proposable=figures.proposable,
    )


FEATURE_ITEM_BYTES = {name: dtype.itemsize for name, dtype in FEATURE_DTYPES.items()}


def features_to_pb(start: int, rows: torch.Tensor, dtype: torch.dtype) -> common_pb2.Features:
    """rows: [N, F] (any float dtype) → Features of positions start .. start + N - 1 in `dtype`."""
    cast = rows.detach().to("cpu", dtype).contiguous()  # [N, F]
    name = str(dtype).removeprefix("torch.")
    data = cast.view(torch.int16 if cast.element_size() == 2 else torch.int32).numpy().tobytes()
    return common_pb2.Features(
        start=start, rows=cast.shape[0], width=cast.shape[1] if cast.dim() == 2 else 0, dtype=name, data=data
    )


def features_from_pb(features: common_pb2.Features) -> tuple[int, torch.Tensor]:
    """Features → (start, rows [N, F] float32), after checking the message's sizes."""
    item = FEATURE_ITEM_BYTES.get(features.dtype)
    if item is None:
        raise InvalidArgument(f"features.dtype {features.dtype!r} is not one of {sorted(FEATURE_ITEM_BYTES)}")
    if features.start < 0 or features.rows < 0 or features.width < 0 or (features.rows and not features.width):
        raise InvalidArgument("features: start, rows and width must be >= 0, and rows come with a width")
    if len(features.data) != features.rows * features.width * item:
        raise InvalidArgument(
            f"features: {len(features.data)} bytes for {features.rows} × {features.width} {features.dtype} values"
        )
    if not features.rows:
        return features.start, torch.empty(0, features.width)
    raw = torch.frombuffer(bytearray(features.data), dtype=torch.int16 if item == 2 else torch.int32)
    values = raw.view(FEATURE_DTYPES[features.dtype])
    rows = values.float().view(features.rows, features.width)  # [N, F]
    if not bool(torch.isfinite(rows).all()):
        raise InvalidArgument("features hold a NaN or an infinity")
    return features.start, rows
