"""Several sessions in one pass of the model, their KV caches padded into a batch: a pass
over their new tokens (`padded_pass`), one over their token trees (`padded_tree_pass`), and a
batch kept from pass to pass that sessions join and leave (DecodeBatch). ModelRunner admits the
sessions to the KV budget (forward_batch, decode_batch) and hands them here."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.engine.batching import hand_back, padded_cache
from specdec.engine.costs import PassCosts
from specdec.engine.kv import plain_cache
from specdec.engine.kv_pool import PoolCache
from specdec.engine.modeling import LoadedModel, session_inputs, with_cache
from specdec.engine.sessions import KVSession, SessionStore
from specdec.engine.static_pass import Row, StaticPasses, tree_row
from specdec.engine.tree_pass import CachedTree, tree_attention_mask, tree_position_ids
from specdec.errors import SpecDecError
from specdec.sampling.tree_sampling import ancestors

logger = logging.getLogger(__name__)


class BatchRunner(Protocol):
    """What a batched pass uses of its runner (specdec.engine.runner.ModelRunner, which builds
    on this module): the model, the KV budget, the pacing and the pass counters."""

    loaded: LoadedModel
    model: PreTrainedModel
    sessions: SessionStore
    kv_bytes_per_token: int
    processed_tokens_total: int
    batched_forwards: int
    batched_sessions_total: int
    max_batch_size_seen: int
    pass_costs: PassCosts | None  # live one-session pass costs (specdec.engine.calibration)

    def _paced(self, new_tokens: int, context_tokens: int) -> AbstractContextManager: ...

    def _synchronize(self) -> None: ...


def admit_session(runner: BatchRunner, session: KVSession, extra_bytes: int, pending_bytes: int) -> Exception | None:
    """Makes room in the KV budget for `session` to grow by `extra_bytes`, beside the
    `pending_bytes` that the other sessions of the same pass (never evicted for it: the caller
    names them to `SessionStore.sharing`) add. A session that does not fit is ended, and its
    exception returned for its caller alone."""
    try:
        runner.sessions.make_room(session, extra_bytes, runner.kv_bytes_per_token, pending_bytes)
    except Exception as exc:  # noqa: BLE001 - handed back to that caller alone
        runner.sessions.end(session.session_id)
        return exc
    return None


def padded_pass(
    runner: BatchRunner, sessions: list[KVSession], token_ids: list[list[int]], logits_to_keep: list[int]
) -> list[torch.Tensor]:
    """One pass over B sessions. Row b of the padded sequence is

        [pad × (P - P_b)] [past_b: P_b cached] [new_b: N_b tokens] [pad × (N - N_b)]

    with P = max P_b and N = max N_b. Pads are masked out as keys; pad queries (at the end)
    still see their row's real tokens, so no attention row is empty (no NaN to leak).
    """
    device = runner.loaded.device
    past = [session.cached_tokens for session in sessions]  # [B]
    new = [len(tokens) for tokens in token_ids]  # [B]
    batch, max_past, max_new = len(sessions), max(past), max(new)
    input_ids = torch.zeros(batch, max_new, dtype=torch.long, device=device)  # [B, N]; pad id 0 is never attended
    attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long, device=device)  # [B, P + N]
    for row, tokens in enumerate(token_ids):
        input_ids[row, : new[row]] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, max_past - past[row] : max_past + new[row]] = 1
    position_ids = (torch.tensor(past)[:, None] + torch.arange(max_new)).to(device)  # [B, N]
    kept = [min(keep, n) for keep, n in zip(logits_to_keep, new)]  # [B]
    width = max(kept)
    # Row b keeps its last `width` real positions (clamped at 0 for short rows: only its
    # last kept[b] are read), so the vocab-wide head runs on B · width positions, not B · N.
    logit_positions = (torch.tensor(new)[:, None] - width + torch.arange(width)).clamp(min=0).to(device)  # [B, width]
    # An accelerator's batched pass, its sessions' real tokens; the caches' padding and
    # splitting inside it, as device memory traffic (specdec.engine.pace).
    with runner._paced(sum(new), sum(past)):
        cache = padded_cache(sessions, past, max_past, runner.model.config)
        out = runner.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **with_cache(runner.model, cache),
            **session_inputs(runner.model, sessions),
            cache_position=torch.arange(max_past, max_past + max_new, device=device),
            use_cache=True,
            logits_to_keep=logit_positions,
        )
        for row, session in enumerate(sessions):
            hand_back(session, cache, row, max_past - past[row], max_past + new[row])
        runner._synchronize()
    _count_pass(runner, sum(new), batch)
    logits = out.logits  # [B, width, V]
    return [logits[row, width - kept[row] :].float() for row in range(batch)]  # each [kept_b, V]


def padded_tree_pass(
    runner: BatchRunner, sessions: list[KVSession], token_ids: list[list[int]], trees: list[tuple[list[int], list[int]]]
) -> list[torch.Tensor]:
    """One pass over B sessions' token trees. Row b is laid out as in `padded_pass`,
    its new tokens followed by its N_b nodes; the 4D mask gives each row its left pad, its
    past, its new tokens (causal) and, for a node, its ancestors (specdec.engine.tree_pass). Each
    session keeps its past, new tokens and every node, as `forward_tree` leaves it."""
    past = [session.cached_tokens for session in sessions]  # [B]
    runs = [tokens + nodes for tokens, (nodes, _) in zip(token_ids, trees)]
    batch, max_past, width = len(sessions), max(past), max(len(run) for run in runs)
    dtype = next(runner.model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    input_ids = torch.zeros(batch, width, dtype=torch.long)  # [B, Q]; pads never attended
    mask = torch.full((batch, 1, width, max_past + width), torch.finfo(dtype).min, dtype=dtype)  # [B, 1, Q, P + Q]
    positions = torch.zeros(batch, width, dtype=torch.long)  # [B, Q]
    keep = max(len(nodes) for nodes, _ in trees) + 1
    logit_positions = torch.zeros(batch, keep, dtype=torch.long)  # [B, 1 + max N_b]
    for row, (tokens, (_, parents)) in enumerate(zip(token_ids, trees)):
        length = len(runs[row])
        input_ids[row, :length] = torch.tensor(runs[row])
        paths = ancestors(parents)
        row_mask = tree_attention_mask(paths, past[row], len(tokens), dtype)[0, 0]  # [Q_b, P_b + Q_b]
        mask[row, 0, :length, max_past - past[row] : max_past + length] = row_mask
        mask[row, 0, length:, max_past - past[row] : max_past + 1] = 0.0  # pad queries: no empty row
        positions[row, :length] = tree_position_ids(paths, past[row], len(tokens))[0]
        rows = torch.arange(len(tokens) - 1, length)  # the root and the nodes: [1 + N_b]
        logit_positions[row, : len(rows)] = rows
    with runner._paced(sum(len(run) for run in runs), sum(past)):  # the caches' traffic inside, as above
        cache = padded_cache(sessions, past, max_past, runner.model.config)
        out = _tree_batch_pass(runner, input_ids, mask, positions, cache, logit_positions)
        for row, (session, run) in enumerate(zip(sessions, runs)):
            hand_back(session, cache, row, max_past - past[row], max_past + len(run))
    results = []
    for row, (session, (nodes, parents)) in enumerate(zip(sessions, trees)):
        length = len(runs[row])
        session.tree = CachedTree(len(session.tokens), tuple(nodes), tuple(parents), len(nodes))
        results.append(out.logits[row, : len(nodes) + 1].float())  # [1 + N_b, V]
    _count_pass(runner, sum(len(run) for run in runs), batch)
    return results


def static_batch(
    runner: BatchRunner,
    static: StaticPasses,
    sessions: list[KVSession],
    token_ids: list[list[int]],
    indices: list[int],
    logits_to_keep: list[int],
    trees: list[tuple[list[int], list[int]]] | None,
) -> list[torch.Tensor]:
    """`padded_pass` or `padded_tree_pass` as one static pass (specdec.engine.static_pass):
    each session's entries stay in its own extent, read in place, with nothing padded in or
    handed back. `indices`: each session's item of `logits_to_keep` and `trees`."""
    rows = []
    for session, tokens, index in zip(sessions, token_ids, indices):
        if trees is None:
            rows.append(Row(session.cache, tokens, keep=logits_to_keep[index]))
        else:
            rows.append(tree_row(session.cache, tokens, *trees[index]))
    new, past = sum(len(row.token_ids) for row in rows), sum(session.cached_tokens for session in sessions)
    with runner._paced(new, past):
        logits = static.run(rows)
        runner._synchronize()
    if trees is not None:
        for session, index in zip(sessions, indices):
            nodes, parents = trees[index]
            session.tree = CachedTree(len(session.tokens), tuple(nodes), tuple(parents), len(nodes))
    _count_pass(runner, new, len(rows))
    return logits


def _tree_batch_pass(runner: BatchRunner, input_ids, mask, positions, cache, logit_positions):
    """The model over a batch of token trees (laid out by `padded_tree_pass`)."""
    device = runner.loaded.device
    out = runner.model(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        **with_cache(runner.model, cache),
        use_cache=True,
        logits_to_keep=logit_positions.to(device),
    )
    runner._synchronize()
    return out


def _count_pass(runner: BatchRunner, tokens: int, batch: int, started: float | None = None) -> None:
    """Adds a batched pass of `batch` sessions and `tokens` real tokens to the runner's counters;
    a decode batch's pass of one session (begun at `started`) is a live one-session pass too."""
    if batch == 1 and started is not None and runner.pass_costs is not None:
        runner.pass_costs.observe(tokens, (time.perf_counter() - started) * 1e3)
    runner.processed_tokens_total += tokens
    runner.batched_forwards += 1
    runner.batched_sessions_total += batch
    runner.max_batch_size_seen = max(runner.max_batch_size_seen, batch)


class DecodeBatch:
    """Sessions stepping together in one padded batch kept from pass to pass
    (ModelRunner.decode_batch), which sessions join and leave between passes: iteration-level
    batching, as Orca and vLLM schedule. Row b holds, column by column,

        [pad …] [past_b: its cache when it joined] [each pass since: its tokens, right-padded to the pass's widest row]

    and `_mask` [B, W] marks its real entries, so pads (before a past; after a row's tokens in
    a pass where another row ran more) are never attended as keys. A pass's pad queries see
    their row's real entries, so no attention row is empty (no NaN to leak). Positions count
    each row's real entries only.

    A session's cache is padded in once, at the first pass after it joins, and split back
    once, when it leaves (`leave`, `close`): a pass of `forward_batch` copies every session's
    cache in and out instead, a copy per layer and session on each side of every pass.
    Joining, and dropping the rows that left, run inside the next pass's emulated time
    (specdec.engine.pace), as a device's memory traffic would; a split runs on the host.
    """

    def __init__(self, runner: BatchRunner):
        self._runner = runner
        self.sessions: list[KVSession] = []  # [B] the rows, in order
        self._lengths: list[int] = []  # [B] real entries each row holds: its next position
        self._cache: DynamicCache | None = None  # per layer [B, H, W, D]; None before the first pass
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=runner.loaded.device)  # [B, W]: 1 at real entries
        self._joining: list[KVSession] = []  # padded in at the next pass
        self._left: set[int] = set()  # rows split back already, dropped at the next pass
        self._failed = False

    def join(self, session: KVSession, new_tokens: int) -> Exception | None:
        """Admits `session` (one with a cache, empty for a prompt; no other session of the
        batch has its id) to grow by `new_tokens` in this batch, beside what the batch's other
        sessions were admitted for (the store holds that: `SessionStore.hold`), as
        `forward_batch` admits a pass; it joins at the next pass. One that does not fit is ended
        and its exception returned, for its caller alone."""
        extra_bytes = new_tokens * self._runner.kv_bytes_per_token
        with self._runner.sessions.sharing(member.session_id for member in (*self.sessions, *self._joining)):
            failure = admit_session(self._runner, session, extra_bytes, 0)
        if failure is None:
            self._joining.append(session)
            self._runner.sessions.hold(session.session_id, extra_bytes)
        return failure

    @torch.inference_mode()
    def step(self, feeds: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One pass: every session in the batch (by id) runs its tokens, at least one each.
        → each one's logits [V] at its last token (float32). A failed pass ends every session
        of the batch and raises."""
        runner, device = self._runner, self._runner.loaded.device
        members = [session for row, session in enumerate(self.sessions) if row not in self._left] + self._joining
        if self._failed or sorted(feeds) != sorted(s.session_id for s in members) or not all(feeds.values()):
            raise AssertionError("a decode batch steps each of its sessions, one token or more, until a pass fails")
        new = sum(len(tokens) for tokens in feeds.values())
        started = time.perf_counter()
        static = getattr(runner, "static", None)
        if self._cache is None and static is not None:
            if static.fits([(session.cache, len(feeds[session.session_id])) for session in members]):
                return self._static_step(static, members, feeds, started)
            # Padded from here on: every member's cache is its own and current, so all join anew.
            self.sessions, self._lengths, self._left, self._joining = [], [], set(), members
        try:
            context = sum(session.cached_tokens for session in self._joining) + sum(
                length for row, length in enumerate(self._lengths) if row not in self._left
            )
            with runner._paced(new, context):
                self._regroup()
                rows = [feeds[session.session_id] for session in self.sessions]  # B × [N_b]
                batch, width = len(rows), max(len(tokens) for tokens in rows)
                input_ids = torch.zeros(
                    batch, width, dtype=torch.long, device=device
                )  # [B, N]; pad id 0 is never attended
                block = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, N]: 1 at real tokens
                for row, tokens in enumerate(rows):
                    input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                    block[row, : len(tokens)] = 1
                positions = (torch.tensor(self._lengths)[:, None] + torch.arange(width)).to(device)  # [B, N]
                start = self._mask.shape[1]
                self._mask = torch.cat([self._mask, block], dim=1)  # [B, W + N]
                last = torch.tensor([[len(tokens) - 1] for tokens in rows], device=device)  # [B, 1]
                out = runner.model(
                    input_ids=input_ids,
                    attention_mask=self._mask,
                    position_ids=positions,
                    **with_cache(runner.model, self._cache),
                    **session_inputs(runner.model, self.sessions),
                    cache_position=torch.arange(start, start + width, device=device),
                    use_cache=True,
                    logits_to_keep=last,
                )
                runner._synchronize()
        except BaseException:
            self._failed = True
            for session in [*self.sessions, *self._joining]:  # a half-updated batch cannot be split back
                runner.sessions.end(session.session_id)
            raise
        self._lengths = [length + len(tokens) for length, tokens in zip(self._lengths, rows)]
        _count_pass(runner, new, batch, started)
        logits = out.logits[:, -1].float()  # [B, V]
        return {session.session_id: logits[row] for row, session in enumerate(self.sessions)}

    def _static_step(
        self, static: StaticPasses, members: list[KVSession], feeds: dict[str, list[int]], started: float
    ) -> dict[str, torch.Tensor]:
        """`step` as one static pass (specdec.engine.static_pass): each member's entries stay
        in its own extent, so nothing is padded in now or split back when it leaves."""
        runner = self._runner
        rows = [Row(session.cache, feeds[session.session_id]) for session in members]
        new = sum(len(row.token_ids) for row in rows)
        try:
            with runner._paced(new, sum(session.cached_tokens for session in members)):
                logits = static.run(rows)
                runner._synchronize()
        except BaseException:
            self._failed = True
            for session in members:
                runner.sessions.end(session.session_id)
            raise
        self.sessions, self._joining, self._left = members, [], set()
        self._lengths = [session.cached_tokens for session in members]
        for session in members:  # its new entries are in its own cache now, which the budget counts
            runner.sessions.grown(session.session_id, len(feeds[session.session_id]) * runner.kv_bytes_per_token)
        _count_pass(runner, new, len(rows), started)
        return {session.session_id: row[-1] for session, row in zip(members, logits)}

    def _regroup(self) -> None:
        """Drops the rows that left and the columns no row holds any more, then pads in the
        sessions that joined (widening every row on the left where a newcomer's past is longer)."""
        layers = [] if self._cache is None else _tensors(self._cache)
        if self._left:
            kept = [row for row in range(len(self.sessions)) if row not in self._left]
            index = torch.tensor(kept, dtype=torch.long, device=self._mask.device)
            self._mask = self._mask.index_select(0, index)
            held = self._mask.any(dim=0)  # [W]
            first = int(held.int().argmax()) if bool(held.any()) else self._mask.shape[1]
            self._mask = self._mask[:, first:]
            layers = [
                (keys.index_select(0, index)[:, :, first:], values.index_select(0, index)[:, :, first:])
                for keys, values in layers
            ]
            self.sessions = [self.sessions[row] for row in kept]
            self._lengths = [self._lengths[row] for row in kept]
            self._left = set()
        if self._joining:
            past = [session.cached_tokens for session in self._joining]
            width = max(self._mask.shape[1], *past)
            if layers and width > self._mask.shape[1]:  # widen the rows already here
                grow = width - self._mask.shape[1]
                self._mask = torch.nn.functional.pad(self._mask, (grow, 0))
                layers = [
                    (torch.nn.functional.pad(k, (0, 0, grow, 0)), torch.nn.functional.pad(v, (0, 0, grow, 0)))
                    for k, v in layers
                ]
            if any(past):
                pairs = _tensors(padded_cache(self._joining, past, width, self._runner.model.config))
            else:  # prompts: rows of pads only (none if nothing is cached yet: the pass makes it)
                pairs = [(_pad_rows(k, len(past), width), _pad_rows(v, len(past), width)) for k, v in layers]
            layers = (
                [(torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(layers, pairs)]
                if layers
                else pairs
            )
            mask = torch.zeros(len(past), width, dtype=torch.long, device=self._mask.device)
            for row, length in enumerate(past):
                mask[row, width - length :] = 1
            self._mask = torch.cat([self._mask, mask]) if self._mask.numel() else mask
            self.sessions += self._joining
            self._lengths += past
            self._joining = []
        self._cache = plain_cache(layers) if layers else DynamicCache(config=self._runner.model.config)

    @torch.inference_mode()
    def leave(self, session_id: str) -> None:
        """Hands the session its cache now: a copy of its row's real entries, its past and
        every token it ran (the batch's tensors are not kept alive by it). Its row is dropped at
        the next pass. One that joined and never ran leaves as it came; nothing to do after a
        failed pass (every session was ended)."""
        self._runner.sessions.release(session_id)
        if any(session.session_id == session_id for session in self._joining):
            self._joining = [session for session in self._joining if session.session_id != session_id]
            return
        row = next(row for row, session in enumerate(self.sessions) if session.session_id == session_id)
        if self._failed or row in self._left:
            return
        self._left.add(row)
        if self._cache is None:
            return
        real = self._mask[row].nonzero().squeeze(1)  # [L_b] the row's columns
        layers: list = self._cache.layers
        entries = [
            (layer.keys[row : row + 1].index_select(2, real), layer.values[row : row + 1].index_select(2, real))
            for layer in layers
        ]
        session = self.sessions[row]
        if isinstance(session.cache, PoolCache):
            length, room = entries[0][0].shape[-2], session.cache.reserved_tokens
            if length > room:
                # Joining reserved room for every token the call may run, so this is a bug, not a
                # full pool: it would fail only calls that drew long (issue 65's bias), so it
                # fails loudly, and the session, whose cache lacks the batch's entries, ends.
                self._runner.sessions.end(session_id)
                raise SpecDecError(
                    f"session {session_id!r} left a decode batch with {length} entries, more than the {room} "
                    "its join reserved"
                )
            session.cache.load(entries)  # one copy into its extent, within that room
        else:
            session.cache = plain_cache(entries)

    def close(self) -> None:
        """Every session still in the batch leaves (`leave`); one that cannot is ended (and
        logged), and the others still leave."""
        for session in [*self.sessions, *self._joining]:
            try:
                self.leave(session.session_id)
            except SpecDecError:
                logger.exception("a decode batch ended a session it could not hand back")
        self._cache = None


def _pad_rows(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Zeros for `rows` rows of `width` entries, shaped as batch tensor `like` [B, H, W, D]."""
    return like.new_zeros(rows, like.shape[1], width, like.shape[3])


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each layer of a cache of plain full-attention layers (batchable_cache)."""
    layers: list[Any] = cache.layers  # transformers types a layer as any cache kind's
    return [(layer.keys, layer.values) for layer in layers]
