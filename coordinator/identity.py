"""What makes two replicas one pool's: the Info fields every replica must report as the
pool's first did (`IDENTITY`), and a refusal that names each field that differs."""

from __future__ import annotations

from specdec.v1 import common_pb2

# What every replica of a pool must report as the first one did. A target replica that
# differs in any of these would give another output. A draft replica must speak the same
# token ids; it may be another drafter (a draft restarted as prompt lookup goes on serving,
# with a round following the Info of the replica that rejected a call), since any draft keeps
# the output exact and only the speed changes: a different model is logged, not refused.
IDENTITY = {
    "target": (
        # The weights, not the path (model_id): replicas on other machines may load the same
        # checkpoint from other folders, and one folder name may hold another checkpoint on
        # another machine, whose output a request failing over would mix with the first's.
        "weights_fingerprint",
        "tokenizer_fingerprint",
        "vocab_size",
        "max_context",
        # The numerics: the same weights give other logits in another dtype or quantisation,
        # through another kind of device's kernels, or split over another number of ranks.
        "dtype",
        "quantization",
        "device_kind",
        "tensor_parallel_size",
        # Copies run up to the first replica's cap (max_copied_tokens), and a replica with a
        # lower one (an older build's default of 16) would refuse such verifies.
        "max_speculative_tokens",
    ),
    # A draft of another family drafts within the tokens it shares with the target: replicas
    # must share the same ones (ModelInfo.vocab_bridge; empty for a draft of the target's).
    "draft": (
        "tokenizer_fingerprint",
        "vocab_size",
        "vocab_bridge.draft_tokenizer_fingerprint",
        "vocab_bridge.proposable",
        # A request's K is checked against the pool's first replica: one serving fewer drafts
        # a call would refuse its rounds' calls.
        "max_speculative_tokens",
    ),
}
# EAGLE heads of one pool read one target's features (its layers, its weights): compared where
# both replicas are heads that say, since a draft restarted as another drafter still serves.
HEAD_IDENTITY = ("feature_layers", "feature_target_fingerprint", "feature_target_checkpoint")
# Reported since the weights fingerprint: a target replica or reference of an older build,
# which reports neither, is compared by its path (model_id) instead, as those builds were.
FINGERPRINTED = ("weights_fingerprint", "device_kind")


def mismatch(role: str, reference: common_pb2.ModelInfo, info: common_pb2.ModelInfo) -> str:
    """What makes `info` another model than the pool's (`reference`), in words: each field
    that differs, with this replica's value and the pool's; empty if none."""
    differ = [
        f"{name} {str(_field(info, name))[:64]!r} (the pool's {str(_field(reference, name))[:64]!r})"
        for name in identity(role, reference, info)
        if _field(info, name) != _field(reference, name)
    ]
    if not differ:
        return ""
    return (
        f"it serves model_id {info.model_id!r} where the pool serves {reference.model_id!r}, "
        f"and they differ in {'; '.join(differ)}"
    )


def identity(role: str, reference: common_pb2.ModelInfo, info: common_pb2.ModelInfo) -> tuple[str, ...]:
    """The fields `info` must match the reference's in (IDENTITY; FINGERPRINTED's fallback
    to the path where either is of an older build; HEAD_IDENTITY where both are heads)."""
    fields = IDENTITY[role]
    if role == "target" and not (info.weights_fingerprint and reference.weights_fingerprint):
        return ("model_id", *(name for name in fields if name not in FINGERPRINTED))
    if role == "draft":
        return (*fields, *(name for name in HEAD_IDENTITY if _field(info, name) and _field(reference, name)))
    return fields


def served(info: common_pb2.ModelInfo) -> str:
    """The model a replica serves, in words: its path and the start of its weights' fingerprint."""
    return f"{info.model_id} (weights {info.weights_fingerprint[:12]})" if info.weights_fingerprint else info.model_id


def _field(info: common_pb2.ModelInfo, dotted: str):
    """A field of ModelInfo by its dotted path (an unset message reads as its defaults)."""
    value = info
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
