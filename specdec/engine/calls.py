"""What every runner call shares, model or not: argument checks, timing, and the runner-side
view of the Info RPC. No torch here, so the protobuf codec (specdec.rpc.wire) can import it."""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.errors import InvalidArgument


@functools.cache
def this_host() -> str:
    """ModelInfo.host_id: the kernel's boot id, which every process and container on this
    machine shares (they share its processors too); the host name where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def these_cpus() -> tuple[int, ...]:
    """ModelInfo.cpus: the CPUs this process may run on (taskset, a cpuset); () where the
    platform does not say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


@dataclass(frozen=True)
class ModelDescription:
    """Runner-side view of the Info RPC."""

    model_id: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    dtype: str
    device: str
    open_sessions: int
    max_speculative_tokens: int
    fork_sessions: int = 0  # of open_sessions, forks no call has continued (ModelInfo.fork_sessions)
    max_sessions: int = 0  # held at most (--max-sessions); 0 = not said
    kv_cache_bytes: int = 0  # held over all sessions
    max_kv_cache_bytes: int = 0  # the budget; 0 = none
    kv_bytes_per_token: int = 0  # what one cached token costs
    evicted_sessions: int = 0  # dropped to fit the budget since start
    tensor_parallel_size: int = 1  # ranks sharing every layer (--tensor-parallel)
    calibrated_pass_ms: tuple[float, ...] = ()  # [n - 1]: ms of a pass over n new tokens, from start-up
    live_pass_ms: tuple[float, ...] = ()  # the same from recent live passes (costs.PassCosts.live_ms)
    cost_context_tokens: int = 0  # cached tokens under the calibrated passes
    calibrated_batch_ms: tuple[tuple[int, int, float], ...] = ()  # (sessions, new tokens each, ms)
    max_batch_size: int = 1
    copies: bool = False  # a draft that copies by prompt lookup (honours max_copied_tokens)
    trees: bool = False  # serves token trees (ProposeRequest.tree_widths / VerifyRequest.draft_parents)
    quantization: str = ""  # the Linear layers' quantisation ("" = none), e.g. specdec.engine.quantize.INT8_LABEL
    weights_fingerprint: str = ""  # of the weights as served (specdec.engine.fingerprint); "" = no model
    device_kind: str = ""  # where the weights sit: "cpu", "cuda", "cpu+cuda"; "" = no model
    feature_layers: tuple[int, ...] = ()  # an EAGLE head: the target's hidden states it reads
    feature_target_fingerprint: str = ""  # an EAGLE head: the weights of the target it was made for
    checkpoint_fingerprint: str = ""  # the model folder's tensors as stored (fingerprint.checkpoint_fingerprint)
    feature_target_checkpoint: str = ""  # an EAGLE head: the checkpoint it reads (trained on, or --model)
    pass_cost_profile: str = ""  # the accelerator the passes are held to (bench.emulated), "" = none
    static_passes: str = ""  # --cuda-graphs: the buckets run so far (StaticPasses.describe), "" = eager
    emulation_overruns: int = 0  # passes whose real compute took longer than that profile allows
    # The prefix cache's figures (ModelInfo.prefix_cache): bytes, max_bytes, block_tokens, lookups,
    # hits, tokens_saved; () when it is off.
    prefix_cache: tuple[int, ...] = ()
    # A draft for a target with another tokenizer (ModelInfo.vocab_bridge): an object with
    # draft_model_id, draft_tokenizer_fingerprint, shared_tokens, caller_vocab_tokens and
    # proposable (draft_service.vocab_bridge.BridgeFigures); None otherwise.
    vocab_bridge: object | None = None
    host_id: str = field(default_factory=this_host)  # ModelInfo.host_id: whose processors run the passes
    cpus: tuple[int, ...] = field(default_factory=these_cpus)  # ModelInfo.cpus: the ones this process may use

    @property
    def numerics(self) -> str:
        return numerics(self.dtype, self.quantization)

    @classmethod
    def of(cls, source, dtype: str, device: str, open_sessions: int, max_speculative_tokens: int) -> ModelDescription:
        """From a LoadedModel or a TokenizerInfo: both carry the model's id space."""
        return cls(
            model_id=source.model_id,
            vocab_size=source.vocab_size,
            tokenizer_fingerprint=source.tokenizer_fingerprint,
            eos_token_ids=source.eos_token_ids,
            max_context=source.max_context,
            dtype=dtype,
            device=device,
            open_sessions=open_sessions,
            max_speculative_tokens=max_speculative_tokens,
            checkpoint_fingerprint=getattr(source, "checkpoint_fingerprint", ""),
        )


def numerics(dtype: str, quantization: str) -> str:
    """What computes a model's logits, in words: "float32", or "int8 (...), float32 elsewhere". For
    the target it names the model whose distribution the output has."""
    return f"{quantization}, {dtype} elsewhere" if quantization else dtype


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} contain ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_sequence(keep_tokens: int, new_tokens: list[int]) -> None:
    """A call must leave its session holding something: refused before it touches the session."""
    if keep_tokens == 0 and not new_tokens:
        raise InvalidArgument("the session's sequence is empty; send the prompt as new_tokens")


def check_trees(serves_trees: bool, model_id: str) -> None:
    """Before a tree call opens anything (ModelRunner.trees; Info.trees says so)."""
    if not serves_trees:  # a tree's mask would leave a sliding window out
        raise InvalidArgument(f"{model_id} has sliding-window attention layers: it serves no trees")


def check_context(total: int, max_context: int) -> None:
    if total > max_context:
        raise InvalidArgument(f"sequence would reach {total} tokens; the model's context is {max_context}")


class Stopwatch:
    """Milliseconds since construction."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self._start) * 1e3
