"""The EAGLE drafter (`--drafter eagle --draft-head DIR`, issue 68): the model drafter's steps
(draft_service.stepping: sampling, the exact rows, confidence stops, runner-ups, the draft
vocabulary) over a one-layer head (specdec.engine.eagle) that reads its target's hidden
features, sent with each Propose (ProposeRequest.features).

What a pass reads, per session (FeatureTrack): the target's features where they came, the
head's own predictions where they did not (a pipelined pre-draft, a hedge, a token drafted
this call). A slot computed from a prediction is computed again once the target's feature for
it arrives. A slot's input may be the slot before's output, so a session's tokens run in as
many passes as that takes (`forward`); sessions whose tokens all run in one pass share it
(the decode batches of draft_service.batched, each row reading its own track).
"""

from __future__ import annotations

import dataclasses

import torch

from draft_service.drafter import Proposal, ProposeCall
from draft_service.runner import DraftRunner
from specdec.engine.batching import result_or_error
from specdec.engine.calls import ModelDescription
from specdec.engine.eagle import EagleHead, LoadedHead
from specdec.engine.features import FeatureTrack
from specdec.engine.sessions import KVSession
from specdec.errors import InvalidArgument


class EagleRunner(DraftRunner):
    """The model drafter over an EAGLE head (its settings: DraftStepper's)."""

    takes_static_passes = False  # the head reads its rows' tracks mid-pass: no fixed-shape or captured passes

    def __init__(self, loaded, head: LoadedHead, **settings) -> None:
        super().__init__(loaded, head_ids=head.head_ids, **settings)
        self.head: EagleHead = loaded.model
        self.feature_layers = head.feature_layers
        self.target_fingerprint = head.folder.target_weights_fingerprint
        self.target_checkpoint = head.target_checkpoint
        self.kind = head.folder.kind
        self.recomputed_tokens = 0  # cache slots run again once the target's features came
        self.received_feature_rows = 0  # the target's rows calls brought

    def describe(self) -> ModelDescription:
        return dataclasses.replace(
            super().describe(),
            trees=False,
            feature_layers=self.feature_layers,
            feature_target_fingerprint=self.target_fingerprint,
            feature_target_checkpoint=self.target_checkpoint,
        )

    def propose_one(self, call: ProposeCall) -> Proposal:
        if call.tree_widths:
            raise InvalidArgument("the eagle drafter drafts chains: tree_widths is not served (Info.trees is false)")
        return super().propose_one(call)

    def _open(self, call: ProposeCall, drafts: int):
        """DraftStepper._open, then the call's features into the session's track; slots computed
        from predictions the target's features now replace are cropped, to run again."""
        self._check_features(call)  # before the session opens: a refused call holds none till its TTL
        session, pending, deterministic, generator, clock = super()._open(call, drafts)
        track = self.track_of(session)
        track.rollback(call.keep_tokens)
        track.kv_exact = min(track.kv_exact, session.cached_tokens)
        if call.features is not None:
            start, rows = call.features
            if rows.shape[0]:
                with torch.inference_mode():
                    track.receive(start, self.head.fuse(rows))
                self.received_feature_rows += rows.shape[0]
        cached = session.cached_tokens
        stale = track.stale_from(cached)
        if stale is not None:
            session.model_cache().crop(stale - cached)
            self.recomputed_tokens += cached - stale
            track.kv_exact = min(track.kv_exact, stale)
            pending = session.tokens[stale:]
        return session, pending, deterministic, generator, clock

    def _check_features(self, call: ProposeCall) -> None:
        """The call's feature rows are as wide as the head reads and within the sequence it will
        hold (its kept tokens and new ones)."""
        if call.features is None or not call.features[1].shape[0]:
            return
        start, rows = call.features
        if rows.shape[1] != self.feature_width:
            raise InvalidArgument(
                f"features are {rows.shape[1]} wide; this head reads {self.feature_width} "
                f"(layers {list(self.feature_layers)} of its target)"
            )
        length = call.keep_tokens + len(call.new_tokens)
        if start + rows.shape[0] > length:
            raise InvalidArgument(
                f"features of positions {start}..{start + rows.shape[0] - 1} run past the session's {length} tokens"
            )

    @property
    def feature_width(self) -> int:
        """The width of the target's rows this head reads: H per layer (EAGLE-3: 3 · target H)."""
        return self.head.feature_width

    def track_of(self, session: KVSession) -> FeatureTrack:
        if session.features is None:
            session.features = FeatureTrack(self.head.config.hidden_size)
        return session.features

    def forward(self, session: KVSession, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """ModelRunner.forward in as many passes as the inputs need: a token whose input is
        neither the target's feature nor a prediction made before the pass runs after the token
        before it, where that is the call's short tail (drafts after a pre-draft's guesses);
        a long run without features (a prompt before its first verify) reads zeros in one pass."""
        track = self.track_of(session)
        start, done, logits = session.cached_tokens, 0, None
        while done < len(token_ids):
            count = track.runnable(start + done, len(token_ids) - done, self.max_speculative_tokens + 2)
            logits = super().forward(session, token_ids[done : done + count], min(logits_to_keep, count))
            done += count
        assert logits is not None
        return logits

    def forward_batch(
        self,
        sessions: list[KVSession],
        token_ids: list[list[int]],
        logits_to_keep: list[int],
        trees: list[tuple[list[int], list[int]]] | None = None,
    ) -> list[torch.Tensor | Exception]:
        """ModelRunner.forward_batch over the sessions whose tokens run in one pass; each other
        session alone, in as many passes as its tokens need (`forward`)."""
        calls = list(zip(sessions, token_ids, logits_to_keep))
        shared = [b for b, (session, ids, _) in enumerate(calls) if trees is None and self._one_pass(session, len(ids))]
        if len(shared) < 2:
            shared = []
        outputs = iter(super().forward_batch(*map(list, zip(*(calls[b] for b in shared)))) if shared else ())
        return [next(outputs) if b in shared else result_or_error(self.forward, *call) for b, call in enumerate(calls)]

    def _decodable(self, drafting) -> bool:
        """DraftStepper._decodable, and the call's tokens run in one pass: a decode batch runs
        them so."""
        return super()._decodable(drafting) and self._one_pass(drafting.session, len(drafting.feed))

    def _one_pass(self, session: KVSession, tokens: int) -> bool:
        return self.track_of(session).runnable(session.cached_tokens, tokens, self.max_speculative_tokens + 2) >= tokens
