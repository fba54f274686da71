"""EAGLE heads (issue 68) piece by piece: the target's features are transformers' own hidden
states, the released head layouts load as they are, the coordinator keeps and slices the rows
it forwards, and the drafter refuses what it cannot read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from coordinator.clients import check_pair
from coordinator.features import FeatureRows
from draft_service.config import DraftConfig
from draft_service.drafter import ProposeCall
from draft_service.server import load_runner
from specdec.engine.eagle import EAGLE1, EAGLE3, load_head
from specdec.engine.features import FeatureTrack
from specdec.engine.fingerprint import checkpoint_fingerprint
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.tools.testing import build_eagle_head
from specdec.v1 import common_pb2
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_causal_lm(str(tiny_pair.target), "float32", "cpu")


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        EAGLE1: build_eagle_head(root / EAGLE1, tiny_pair.target, EAGLE1),
        EAGLE3: build_eagle_head(root / EAGLE3, tiny_pair.target, EAGLE3, draft_vocab=40),
    }


def eagle_runner(tiny_pair, head, **settings):
    return load_runner(
        DraftConfig(
            model=str(tiny_pair.target),
            drafter="eagle",
            draft_head=str(head),
            min_confidence=0.0,
            **{"calibrate": False, "quantize": "none", **settings},
        )
    )


def test_verify_features_are_transformers_hidden_states(target):
    runner = TargetRunner(target, 4, 60, 4)
    layers = target.model.config.num_hidden_layers
    tokens = list(range(5, 30))
    first = runner.verify_one(
        VerifyCall("s", 0, tokens[:20], tokens[20:23], torch.zeros(0, 1), GREEDY, 0, feature_layers=(layers, 0, 1))
    )
    second = runner.verify_one(
        VerifyCall("s", 21, tokens[21:24], [9], torch.zeros(0, 1), GREEDY, 0, feature_layers=(layers, 0, 1))
    )
    with torch.inference_mode():
        hidden = target.model(torch.tensor([tokens[:24] + [9]]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[layers][0], hidden[0][0], hidden[1][0]], dim=-1)  # [25, 3H], in the order asked
    assert first.features.shape == (23, expected.shape[1])
    torch.testing.assert_close(first.features, expected[:23], atol=1e-5, rtol=1e-5)
    assert second.features.shape[0] == second.processed_tokens == 4  # positions 21..24
    torch.testing.assert_close(second.features, expected[21:], atol=1e-5, rtol=1e-5)


def test_verify_refuses_feature_layers_it_does_not_have(target):
    runner = TargetRunner(target, 4, 60, 4)
    with pytest.raises(InvalidArgument, match="outside"):
        runner.verify_one(VerifyCall("s", 0, [5, 6], [], torch.zeros(0, 1), GREEDY, 0, feature_layers=(99,)))


def test_released_layouts_are_what_the_loader_reads(tiny_pair, heads):
    """The files as the releases write them (the keys SGLang and vLLM map), and the head loaded from them."""
    eagle3 = load_file(str(heads[EAGLE3] / "model.safetensors"))
    width = json.loads((tiny_pair.target / "config.json").read_text())["hidden_size"]
    assert eagle3["fc.weight"].shape == (width, 3 * width) and "fc.bias" not in eagle3
    assert eagle3["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * width
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight", "d2t", "t2d"} <= set(
        eagle3
    )
    assert eagle3["lm_head.weight"].shape[0] == 40 and "embed_tokens.weight" not in eagle3
    eagle1 = torch.load(heads[EAGLE1] / "pytorch_model.bin", weights_only=True)
    assert eagle1["fc.weight"].shape == (width, 2 * width) and "fc.bias" in eagle1
    assert "layers.0.input_layernorm.weight" not in eagle1 and "layers.0.post_attention_layernorm.weight" in eagle1
    config = json.loads((tiny_pair.target / "config.json").read_text())
    loaded = load_head(heads[EAGLE3], tiny_pair.target, type("C", (), config), torch.float32, "cpu")
    assert torch.equal(loaded.head_ids, torch.arange(40) + eagle3["d2t"])
    assert loaded.feature_layers == (0, 1, 2)  # eagle_config.eagle_aux_hidden_state_layer_ids
    assert load_head(heads[EAGLE1], tiny_pair.target, type("C", (), config), torch.float32, "cpu").feature_layers == (
        2,
    )


def test_a_head_missing_a_weight_is_refused_by_name(tiny_pair, heads, tmp_path):
    state = load_file(str(heads[EAGLE3] / "model.safetensors"))
    del state["midlayer.hidden_norm.weight"]
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text((heads[EAGLE3] / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((tiny_pair.target / "config.json").read_text())
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        load_head(tmp_path, tiny_pair.target, type("C", (), config), torch.float32, "cpu")


def _edited(head, folder, **changes):
    """A copy of `head` in `folder` with its config changed (a key given None is removed)."""
    folder.mkdir()
    for path in head.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    raw = json.loads((head / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


@pytest.mark.parametrize(
    "kind, changes, says",
    [
        (EAGLE3, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "states 0 to 2"),
        (EAGLE3, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}, "128 for those layers"),
        (EAGLE3, {"target_hidden_size": 128}, "384 wide"),
        (EAGLE1, {"vocab_size": 1320}, "vocab_size"),
        (EAGLE3, {"draft_vocab_size": 41}, "d2t maps 40 rows"),
    ],
)
def test_a_head_made_for_another_target_shape_is_refused_at_load(tiny_pair, heads, tmp_path, kind, changes, says):
    """Feature layers the target lacks, or of another width, and another vocabulary: refused
    by name when the head loads, not at every Propose after the service started."""
    config = json.loads((tiny_pair.target / "config.json").read_text())
    folder = _edited(heads[kind], tmp_path / "h", **changes)
    if "target_hidden_size" in changes:  # a head whose fc really reads rows that wide
        from safetensors.torch import save_file

        state = load_file(str(folder / "model.safetensors"))
        state["fc.weight"] = torch.zeros(state["fc.weight"].shape[0], 3 * changes["target_hidden_size"])
        save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=says):
        load_head(folder, tiny_pair.target, type("C", (), config), torch.float32, "cpu")


def test_a_negative_or_foreign_vocabulary_map_is_refused(tiny_pair, heads, tmp_path):
    from safetensors.torch import save_file

    config = json.loads((tiny_pair.target / "config.json").read_text())
    folder = _edited(heads[EAGLE3], tmp_path / "h")
    state = load_file(str(folder / "model.safetensors"))
    save_file(state | {"d2t": state["d2t"] - 3}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="ascending ids"):
        load_head(folder, tiny_pair.target, type("C", (), config), torch.float32, "cpu")
    foreign = torch.zeros(config["vocab_size"] + 500, dtype=torch.bool)
    save_file(state | {"t2d": foreign}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d"):
        load_head(folder, tiny_pair.target, type("C", (), config), torch.float32, "cpu")


def test_the_coordinator_keeps_committed_rows_and_drops_delivered_ones():
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    message = wire.features_to_pb(10, rows, torch.float32)  # positions 10..15
    kept = FeatureRows.committed(message, 14)  # 14 is the committed sequence's last position
    assert (kept.start, kept.rows) == (10, 4)
    later = FeatureRows.committed(wire.features_to_pb(13, rows[:3] + 100, torch.float32), 20)
    joined = kept.then(later)  # position 13 from the later verify
    start, values = wire.features_from_pb(joined.message())
    assert start == 10 and values[:, 0].tolist() == [0, 2, 4, 100, 102, 104]
    assert joined.after(12).start == 12 and joined.after(16) is None and joined.after(3) is joined
    gap = FeatureRows.committed(wire.features_to_pb(30, rows[:1], torch.float32), 40)
    assert kept.then(gap) is gap  # one message holds consecutive rows


def test_features_on_the_wire_round_trip_in_bfloat16():
    rows = torch.randn(3, 5)
    start, back = wire.features_from_pb(wire.features_to_pb(7, rows, torch.bfloat16))
    assert start == 7 and torch.equal(back, rows.to(torch.bfloat16).float())
    with pytest.raises(InvalidArgument, match="bytes"):
        wire.features_from_pb(common_pb2.Features(start=0, rows=2, width=5, dtype="bfloat16", data=b"\0" * 4))


def test_the_drafter_refuses_features_it_cannot_read(tiny_pair, heads):
    """Features of another width or past the sequence are refused before the session opens,
    so a refused call holds none of --max-sessions until its TTL."""
    runner = eagle_runner(tiny_pair, heads[EAGLE3], max_sessions=1)
    call = ProposeCall("s", 0, list(range(5, 15)), 3, GREEDY, 0, features=(0, torch.zeros(4, 7)))
    with pytest.raises(InvalidArgument, match="wide"):
        runner.propose_one(call)
    width = runner.feature_width
    with pytest.raises(InvalidArgument, match="run past"):
        runner.propose_one(ProposeCall("t", 0, list(range(5, 15)), 3, GREEDY, 0, features=(8, torch.zeros(4, width))))
    assert runner.sessions.ids() == []
    runner.propose_one(ProposeCall("good", 0, list(range(5, 15)), 3, GREEDY, 0))  # the one session it may hold
    with pytest.raises(InvalidArgument, match="chains"):
        runner.propose_one(ProposeCall("good", 10, [5, 6], 0, GREEDY, 0, tree_widths=(2, 1)))


def test_slots_drafted_on_predictions_run_again_with_the_targets_features(tiny_pair, heads):
    runner = eagle_runner(tiny_pair, heads[EAGLE1])
    width = runner.feature_width
    proposal = runner.propose_one(ProposeCall("s", 0, list(range(5, 15)), 3, GREEDY, 0))  # no features yet
    session = runner.sessions.peek("s")
    assert runner.track_of(session).kv_exact == 1  # slot 0 only: the prompt read zeros
    sequence = list(range(5, 15)) + proposal.token_ids[:1] + [7]
    runner.propose_one(ProposeCall("s", 11, [7], 3, GREEDY, 0, features=(0, torch.randn(11, width))))
    # Slots 1..10 (the prompt's after slot 0, and the kept draft) read zeros or predictions: run again.
    assert runner.recomputed_tokens == 10 and runner.track_of(session).kv_exact == len(sequence)


def test_a_session_sent_again_from_its_start_drafts_as_a_new_one(tiny_pair, heads):
    """After a failed draft call the coordinator re-sends the whole sequence (keep_tokens 0) to
    the same session. Its track had dropped the positions before its last exact slot, and kept
    that offset: it then ignored the target's features below it, never caught up or trimmed
    again, and drafted on zeros for the rest of the request."""
    runner = eagle_runner(tiny_pair, heads[EAGLE1])
    features = torch.randn(40, runner.feature_width, generator=torch.Generator().manual_seed(0))
    prompt = list(range(5, 25))
    first = runner.propose_one(ProposeCall("s", 0, prompt, 3, GREEDY, 0))
    runner.propose_one(ProposeCall("s", 21, [7], 3, GREEDY, 0, features=(0, features[:21])))
    assert runner.track_of(runner.sessions.peek("s")).base > 0  # it dropped the early positions
    sequence = [*prompt, first.token_ids[0], 7, 9]
    again = {
        session_id: runner.propose_one(ProposeCall(session_id, 0, sequence, 3, GREEDY, 0, features=(0, features[:22])))
        for session_id in ("s", "new")
    }
    assert again["s"].token_ids == again["new"].token_ids
    for bonus in (11, 12, 13):  # rounds whose drafts were all rejected: the bonus and its feature
        for session_id in again:
            keep = len(sequence)
            runner.propose_one(
                ProposeCall(session_id, keep, [bonus], 3, GREEDY, 0, features=(keep - 1, features[keep - 1 : keep]))
            )
        sequence.append(bonus)
    sent_again, new = (runner.track_of(runner.sessions.peek(session_id)) for session_id in again)
    assert (sent_again.kv_exact, sent_again.base, len(sent_again.target)) == (new.kv_exact, new.base, len(new.target))


def test_a_pass_runs_a_slot_after_one_without_the_targets_feature_alone():
    """FeatureTrack.runnable: tokens whose input is the target's feature (or, in a long run, a
    prompt's zeros) share a pass; a short tail's slot after one lacking it waits for its output."""
    track = FeatureTrack(4)
    track.receive(0, torch.ones(3, 4))  # the target's features of positions 0..2
    assert track.runnable(0, 3, short_tail=6) == 3
    assert track.runnable(0, 6, short_tail=6) == 4, "slot 4 reads position 3's, not here yet"
    assert track.runnable(3, 2, short_tail=6) == 1
    assert track.runnable(3, 10, short_tail=6) == 4, "a long run reads zeros until its short tail"


def test_a_head_made_for_other_target_weights_is_refused():
    draft = common_pb2.ModelInfo(tokenizer_fingerprint="t", feature_target_fingerprint="a" * 64, model_id="head")
    target = common_pb2.ModelInfo(tokenizer_fingerprint="t", weights_fingerprint="b" * 64, model_id="target")
    with pytest.raises(InvalidArgument, match="head made for"):
        check_pair(draft, target, "t", "draft:1", "target:2")
    check_pair(draft, common_pb2.ModelInfo(tokenizer_fingerprint="t", weights_fingerprint="a" * 64), "t", "d", "t")


def test_a_head_trained_on_another_checkpoint_is_refused(tiny_pair, heads, tmp_path):
    """At load, beside another target folder, and by the coordinator, beside a target serving
    another checkpoint. A published head, which names none, reads the features of the target
    folder it runs with (--model): a target serving another checkpoint is refused too (before,
    it paired with any, and features of another width failed every verify)."""
    config = json.loads((tiny_pair.target / "config.json").read_text())
    folder = _edited(heads[EAGLE3], tmp_path / "h", target_checkpoint_fingerprint="c" * 64)
    with pytest.raises(ValueError, match="trained on the checkpoint"):
        load_head(folder, tiny_pair.target, type("C", (), config), torch.float32, "cpu")
    ours = checkpoint_fingerprint(tiny_pair.target)
    folder = _edited(heads[EAGLE3], tmp_path / "ours", target_checkpoint_fingerprint=ours)
    loaded = load_head(folder, tiny_pair.target, type("C", (), config), torch.float32, "cpu")
    assert loaded.folder.target_checkpoint_fingerprint == loaded.target_checkpoint == ours
    published = load_head(heads[EAGLE3], tiny_pair.target, type("C", (), config), torch.float32, "cpu")
    assert not published.folder.target_checkpoint_fingerprint and published.target_checkpoint == ours
    draft = common_pb2.ModelInfo(tokenizer_fingerprint="t", feature_target_checkpoint="c" * 64, model_id="head")
    with pytest.raises(InvalidArgument, match="reads the features of checkpoint"):
        check_pair(draft, common_pb2.ModelInfo(tokenizer_fingerprint="t", checkpoint_fingerprint=ours), "t", "d", "t")
    check_pair(draft, common_pb2.ModelInfo(tokenizer_fingerprint="t", checkpoint_fingerprint="c" * 64), "t", "d", "t")
    check_pair(draft, common_pb2.ModelInfo(tokenizer_fingerprint="t"), "t", "d", "t")  # a target that cannot say


def test_the_eagle_drafter_needs_its_head_folder():
    assert "--draft-head" in DraftConfig(model="m", drafter="eagle").problem()
    assert "--draft-head" in DraftConfig(model="m", draft_head="h").problem()


def test_the_compact_form_shards_under_the_file_limit_and_loads_back(tmp_path, monkeypatch):
    from specdec.engine import eagle

    monkeypatch.setattr(eagle, "SHARD_BYTES", 3000)
    state = {
        "fc.weight": torch.randn(40, 48),  # 1,920 bytes as int8
        "midlayer.mlp.up_proj.weight": torch.randn(40, 48),
        "norm.weight": torch.rand(32),
        "d2t": torch.arange(5),
    }
    paths = eagle.save_compact(state, tmp_path, int8=True)
    assert len(paths) > 1 and all(path.stat().st_size < 3000 + 1024 for path in paths)
    back = eagle.head_state(tmp_path)
    assert set(back) == set(state) and torch.equal(back["d2t"], state["d2t"])
    scale = state["fc.weight"].abs().amax(dim=1, keepdim=True) / 127
    assert ((back["fc.weight"] - state["fc.weight"]).abs() <= scale / 2 + 1e-3).all()  # int8 rounding, per row
    torch.testing.assert_close(back["norm.weight"].float(), state["norm.weight"], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_sessions_share_the_heads_passes_and_draft_what_each_drafts_alone(tiny_pair, heads, quantize):
    """propose_batch over an EAGLE head: each row of a shared pass reads its own session's
    track, so every call drafts what it drafts alone. Round 2 brings the target's features; in
    round 3 a call's second token reads the first's output, so that call runs alone, in two
    passes, while the others still share theirs. In int8 too, the CPU's default (which failed
    at start-up: the head has no set_attn_implementation), its batches row by row."""
    lone = eagle_runner(tiny_pair, heads[EAGLE3], quantize=quantize)
    batched = eagle_runner(tiny_pair, heads[EAGLE3], quantize=quantize)
    width = lone.feature_width
    prompts = {f"s{i}": list(range(5 + i, 12 + 3 * i)) for i in range(3)}
    features = {
        sid: torch.randn(len(p) + 1, width, generator=torch.Generator().manual_seed(len(p)))
        for sid, p in prompts.items()
    }
    rounds = [[ProposeCall(sid, 0, prompt, 3, GREEDY, 0) for sid, prompt in prompts.items()]]

    def check(calls):
        want = [lone.propose_one(call) for call in calls]
        got = batched.propose_batch(calls)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids and a.sequence_length == b.sequence_length
            torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
        return want

    first = check(rounds[0])
    assert batched.batched_forwards > 0, "the sessions' draft steps shared no pass"
    second = check(
        [
            ProposeCall(sid, len(prompt) + 1, [7], 3, GREEDY, 0, features=(0, features[sid]))
            for (sid, prompt), proposal in zip(prompts.items(), first)
            if proposal.token_ids
        ]
    )
    shared = batched.batched_forwards
    third = [
        ProposeCall(sid, proposal.sequence_length - 1, [8, 9] if sid == "s0" else [8], 2, GREEDY, 0)
        for sid, proposal in zip(prompts, second)
    ]
    check(third)
    assert batched.batched_forwards > shared
    assert lone.received_feature_rows == batched.received_feature_rows > 0


def test_the_heads_passes_are_calibrated_alone_and_batched(tiny_pair, heads):
    """Its step cost and its batched passes' (copies of a session no call opened, which read
    zeros), as any drafter's; Info says how many sessions a pass serves."""
    runner = eagle_runner(tiny_pair, heads[EAGLE1], calibrate=True, max_batch_size=4)
    assert runner.pass_costs is not None and runner.pass_costs.batch_ms
    assert {sessions for sessions, _, _ in runner.pass_costs.batch_ms} >= {2, 4}
    assert runner.describe().max_batch_size == 4
