"""specdec.tools.train_head on the tiny target: it writes a head folder the drafter loads, with
the command and seed that made it, and a run stopped and resumed ends where a straight run ends."""

from __future__ import annotations

import json
from typing import cast

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdec.engine.eagle import EAGLE3, load_head
from specdec.engine.fingerprint import checkpoint_fingerprint
from specdec.tools import head_data, train_head


def run(target, out, corpus, *more: str):
    args = ["--target", str(target), "--out", str(out), "--corpus", str(corpus), "--windows", "16", "--seq-len", "32"]
    args += ["--layers", "0", "1", "2", "--draft-vocab", "64", "--intermediate-size", "64", "--target-dtype", "float32"]
    args += ["--steps", "6", "--save-every", "2", "--seed", "3", *more]
    return train_head.train(train_head.parse_args(args))


def test_a_resumed_run_ends_where_a_straight_one_does_and_the_head_loads(tiny_pair, tmp_path):
    torch.set_num_threads(1)  # the same sums in the same order, run after run
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, text in enumerate(
        ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"]
    ):
        (corpus / f"{index}.txt").write_text(text * 60)
    straight = run(tiny_pair.target, tmp_path / "straight", corpus)
    shards = sorted((tmp_path / "straight" / "data").glob("shard-*.pt"))
    run(tiny_pair.target, tmp_path / "resumed", corpus, "--stop-after", "3")
    assert not (tmp_path / "resumed" / "model.safetensors").exists()  # stopped: no head yet
    resumed = run(tiny_pair.target, tmp_path / "resumed", corpus, "--resume")
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "d2t", "t2d"} <= set(a)
    assert "lm_head.weight" not in a and "embed_tokens.weight" not in a  # the target's, read at load
    config = json.loads((straight / "config.json").read_text())
    assert config["trained_by"]["seed"] == 3 and "--target" in config["trained_by"]["command"]
    assert config["target_checkpoint_fingerprint"] == checkpoint_fingerprint(tiny_pair.target)
    assert len(shards) == 1
    head = load_head(straight, tiny_pair.target, AutoConfig.from_pretrained(tiny_pair.target), torch.float32, "cpu")
    assert head.folder.kind == EAGLE3 and head.feature_layers == (0, 1, 2) and len(head.head_ids) == 64


def test_agreement_is_with_the_targets_greedy_token_over_its_whole_vocabulary(tiny_pair, tmp_path):
    """The shards carry the target's greedy next token over its whole vocabulary (`top`), and
    the training-time test's agreement is with it, as serving meets it: a slot whose token the
    draft vocabulary lacks is a miss. Compared within the draft vocabulary (shards without
    `top`), such a slot could count as a hit, which overstated the head by the share of those."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n" * 60)
    out = run(tiny_pair.target, tmp_path / "head", corpus)
    shard = torch.load(sorted((out / "data").glob("shard-*.pt"))[0])
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    with torch.inference_mode():
        greedy = target(input_ids=shard["ids"].long()).logits.argmax(-1)  # [W, T]
    assert torch.equal(shard["top"].long(), greedy)
    loaded = load_head(out, tiny_pair.target, AutoConfig.from_pretrained(tiny_pair.target), torch.float32, "cpu")
    head, head_ids = loaded.head, cast(torch.Tensor, loaded.head_ids)
    batch = {key: shard[key][:8] for key in ("ids", "features", "final", "top")}
    within = {key: value for key, value in batch.items() if key != "top"}
    with torch.no_grad():
        _, inside = train_head.ttt_loss(head, head.lm_head.weight, within, 2, head_ids)
        _, whole = train_head.ttt_loss(head, head.lm_head.weight, batch, 2, head_ids)
        restricted = (batch["final"].float() @ head.lm_head.weight.T).argmax(-1)  # [W, T] draft rows
        _, mapped = train_head.ttt_loss(head, head.lm_head.weight, {**batch, "top": head_ids[restricted]}, 2, head_ids)
        _, nowhere = train_head.ttt_loss(
            head, head.lm_head.weight, {**batch, "top": torch.full_like(greedy[:8], -1)}, 2, head_ids
        )
    assert (~torch.isin(batch["top"].long(), head_ids)).any(), "every greedy token in the draft vocabulary"
    assert mapped == inside  # the draft vocabulary's likeliest token, as target ids: the old comparison
    assert all(a <= b for a, b in zip(whole, inside)) and nowhere == [0.0, 0.0]


def test_conversations_the_target_answers_join_the_data_and_a_head_starts_from_another(tiny_pair, tmp_path):
    """--conversations: prompts written from the standard library (chat-formatted) and story
    openers, each followed by the target's own sampled answer, kept so a second run answers
    none again; their windows are shards of their own. --init starts from an earlier head's
    weights and draft vocabulary."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 60)
    first = run(tiny_pair.target, tmp_path / "first", corpus)
    talk = ["--conversations", "10", "--answer-tokens", "12", "--answer-batch", "4", "--init", str(first)]
    second = run(tiny_pair.target, tmp_path / "second", corpus, *talk)
    answered = torch.load(second / "conversations.pt")
    assert len(answered) == 10 and all(len(sequence) > 12 for sequence in answered)
    spoken = sorted((second / "data").glob("conversations-*.pt"))
    assert spoken and torch.load(spoken[0])["ids"].shape == (16, 32)
    assert torch.equal(
        load_file(str(first / "model.safetensors"))["t2d"], load_file(str(second / "model.safetensors"))["t2d"]
    )
    assert json.loads((second / "config.json").read_text())["trained_by"]["init"]["trained_by"]["seed"] == 3
    saved = (second / "conversations.pt").stat().st_mtime_ns
    run(tiny_pair.target, tmp_path / "second", corpus, *talk)  # answers and features kept: nothing made again
    assert (second / "conversations.pt").stat().st_mtime_ns == saved


def test_a_run_stopped_after_its_answers_starts_its_head_as_a_straight_run(tiny_pair, tmp_path):
    """The target's sampled answers draw from torch's generator: a run that finds them made
    (stopped before its first saved step) still starts its head from the seed's weights."""
    torch.set_num_threads(1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\nThe quick brown fox.\n" * 60)
    talk = ["--conversations", "4", "--answer-tokens", "4", "--answer-batch", "2", "--steps", "2"]
    straight = run(tiny_pair.target, tmp_path / "straight", corpus, *talk)
    args = ["--target", str(tiny_pair.target), "--out", str(tmp_path / "resumed"), "--corpus", str(corpus)]
    args += ["--windows", "16", "--seq-len", "32", "--seed", "3", *talk]
    target = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    head_data.collect(train_head.parse_args(args), target, tokenizer, (0, 1, 2))  # stopped once its data was made
    resumed = run(tiny_pair.target, tmp_path / "resumed", corpus, *talk, "--resume")
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_shards_made_with_other_settings_and_a_foreign_init_head_are_refused(tiny_pair, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 60)
    first = run(tiny_pair.target, tmp_path / "first", corpus, "--steps", "1")
    run(tiny_pair.target, first, f"{corpus}/", "--steps", "1", "--resume")  # the same corpus, named otherwise
    again = ["--target", str(tiny_pair.target), "--out", str(first), "--corpus", str(corpus), "--windows", "16"]
    with pytest.raises(SystemExit, match="layers"):  # the data's features are of layers 0, 1, 2
        train_head.train(train_head.parse_args([*again, "--seq-len", "32", "--layers", "0", "1", "1"]))
    state = load_file(str(first / "model.safetensors"))
    save_file(state | {"t2d": torch.ones(7, dtype=torch.bool)}, str(first / "model.safetensors"))
    with pytest.raises(SystemExit, match="draft vocabulary over"):
        run(tiny_pair.target, tmp_path / "second", corpus, "--init", str(first))


def test_conversation_prompts_are_seeded_and_never_the_benchmarks(tiny_pair):
    from transformers import AutoTokenizer

    from bench.eagle import prompts as bench_prompts
    from specdec.tools import conversations, head_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    stdlib = head_data.corpus_files("")
    made = conversations.prompts(tokenizer, stdlib, 200, seed=0)
    assert (
        made
        == conversations.prompts(tokenizer, stdlib, 200, seed=0)
        != conversations.prompts(tokenizer, stdlib, 200, seed=1)
    )
    assert sum(text.endswith(", and") for text in made) == 40  # one in five continues a story
    bench = [prompt["text"] for prompt in bench_prompts()]
    requests = {text.split("user")[-1][:60] for text in made}
    assert not any(request in text for text in bench for request in requests)


def test_a_resume_with_other_settings_is_refused_and_a_finished_run_is_left_as_it_is(tiny_pair, tmp_path):
    """A resumed run with another schedule, batch or vocabulary trained on under the earlier
    weights without a word; rerunning a finished one (as `make head` does) exported its head
    again with no agreement recorded."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 60)
    out = tmp_path / "head"
    run(tiny_pair.target, out, corpus, "--stop-after", "2")
    with pytest.raises(SystemExit, match="other settings .*'lr'"):
        run(tiny_pair.target, out, corpus, "--resume", "--lr", "1e-3")
    run(tiny_pair.target, out, corpus, "--resume")
    trained_by = json.loads((out / "config.json").read_text())["trained_by"]
    assert trained_by["top1_agreement_last_batch"]
    run(tiny_pair.target, out, corpus, "--resume")
    assert json.loads((out / "config.json").read_text())["trained_by"] == trained_by


def test_data_made_with_another_checkpoint_of_the_same_shape_is_refused(tiny_pair, tmp_path):
    """The shards' features and the head's label are one checkpoint's: a fine-tune of the same
    architecture matched the old check, and its head was labelled with a checkpoint it never saw."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 60)
    out = tmp_path / "head"
    run(tiny_pair.target, out, corpus, "--steps", "1")
    tuned = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    with torch.no_grad():
        cast(torch.nn.Module, tuned).get_input_embeddings().weight.add_(0.01)
    tuned.save_pretrained(tmp_path / "tuned")
    AutoTokenizer.from_pretrained(tiny_pair.target).save_pretrained(tmp_path / "tuned")
    with pytest.raises(SystemExit, match="checkpoint"):
        run(tmp_path / "tuned", out, corpus, "--steps", "1")
