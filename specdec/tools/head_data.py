"""The training data of an EAGLE-3 head (specdec.tools.train_head, its steps 1-3): windows of
text, the target's answers to written prompts, the target's hidden features over both in
resumable shards, and the draft vocabulary they give."""

from __future__ import annotations

import json
import math
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.engine.features import FeatureTap, decoder_parts
from specdec.engine.fingerprint import checkpoint_fingerprint
from specdec.tools import conversations

SHARD_WINDOWS = 16  # windows per data shard


def corpus_files(corpus: str) -> list[Path]:
    """The text files to learn from: --corpus's files, or the standard library's sources."""
    root = Path(corpus) if corpus else Path(sysconfig.get_paths()["stdlib"])
    pattern = "*" if corpus else "*.py"
    files = sorted(path for path in root.rglob(pattern) if path.is_file() and "site-packages" not in path.parts)
    if not files:
        raise SystemExit(f"no text files under {root}")
    return files


def windows(tokenizer, files: list[Path], seq_len: int, count: int, seed: int) -> Iterator[list[int]]:
    """`count` windows of `seq_len` tokens from the files in a seeded order, each file's text
    followed by the end-of-text token."""
    order = list(files)
    random.Random(seed).shuffle(order)
    buffer: list[int] = []
    made = 0
    eos = tokenizer.eos_token_id
    for path in order:
        text = path.read_text(errors="replace")
        if not text.strip():
            continue
        buffer += tokenizer(text, add_special_tokens=False).input_ids + ([eos] if eos is not None else [])
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
            made += 1
            if made == count:
                return


def collect(args, target, tokenizer, layers: tuple[int, ...]) -> list[Path]:
    """The data shards (OUT/data/shard-N.pt from the corpus, then conversations-N.pt from
    --conversations: ids [W, T] int32, features [W, T, 3H] and final hidden states [W, T, H] in
    bfloat16, the target's greedy next token `top` [W, T] int32), making those not yet there."""
    data = Path(args.out) / "data"
    data.mkdir(parents=True, exist_ok=True)
    check_made_with(data, args, target, layers)
    shards = math.ceil(args.windows / SHARD_WINDOWS)
    paths = [data / f"shard-{index:05d}.pt" for index in range(shards)]
    if any(not path.is_file() for path in paths):
        stream = windows(tokenizer, corpus_files(args.corpus), args.seq_len, shards * SHARD_WINDOWS, args.seed)
        batches = [list(batch) for batch in _chunks(stream, SHARD_WINDOWS)]
        if len(batches) < shards:
            raise SystemExit(
                f"the corpus holds {len(batches) * SHARD_WINDOWS} windows of {args.seq_len} tokens; ask fewer"
            )
        _features(target, layers, paths, batches)
    if not args.conversations:
        return paths
    texts = conversations.prompts(tokenizer, corpus_files(""), args.conversations, args.seed)
    sequences = conversations.answered(
        target,
        tokenizer,
        texts,
        args.answer_tokens,
        args.answer_batch,
        args.answer_temperature,
        args.seed,
        Path(args.out) / "conversations.pt",
    )
    cut = conversations.cut(sequences, args.seq_len, tokenizer.eos_token_id)
    batches = [list(batch) for batch in _chunks(iter(cut), SHARD_WINDOWS)]
    spoken = [data / f"conversations-{index:05d}.pt" for index in range(len(batches))]
    _features(target, layers, spoken, batches)
    return paths + spoken


def check_made_with(data: Path, args, target, layers: tuple[int, ...]) -> None:
    """The settings the shards in `data` are made with, in data/made-with.json: a later run
    into the same folder with others (other layers, window length, corpus, seed, target
    checkpoint or dtype, or answers written otherwise) would train on features and answers its
    head does not read, or label a head with a checkpoint it never saw, so it stops, saying which
    differ. A setting an older folder did not record is taken as it is now."""
    text = target.config.get_text_config()
    made = {
        "layers": list(layers),
        "seq_len": args.seq_len,
        "corpus": str(Path(args.corpus).resolve()) if args.corpus else "",
        "seed": args.seed,
        "target": [text.model_type, text.hidden_size, text.num_hidden_layers, text.vocab_size],
        "checkpoint": checkpoint_fingerprint(args.target),
        "target_dtype": str(target.dtype).removeprefix("torch."),  # what computed the features
    }
    if args.conversations:
        made["answers"] = [args.answer_tokens, args.answer_batch, args.answer_temperature]
    path = data / "made-with.json"
    if path.is_file():
        earlier = json.loads(path.read_text())
        made = {**earlier, **made}  # answers recorded by an earlier run stay recorded
        differ = {key: (earlier.get(key), value) for key, value in made.items() if earlier.get(key, value) != value}
        if differ:
            raise SystemExit(
                f"{data} holds shards made with other settings (then, now): {differ}; "
                "give a new --out, or delete that folder to make them again"
            )
    path.write_text(json.dumps(made))


def _features(target, layers: tuple[int, ...], paths: list[Path], batches: list[list[list[int]]]) -> None:
    """The target over each batch of windows whose shard is not there yet, saved to its path."""
    todo = [index for index, path in enumerate(paths) if not path.is_file()]
    if not todo:
        return
    num_layers = len(decoder_parts(target)[1])
    tapped = tuple(dict.fromkeys((*layers, num_layers)))  # the final norm's output may be one of them
    tap = FeatureTap(target, tapped)
    width = target.config.get_text_config().hidden_size
    lm_head = target.get_output_embeddings()
    with tqdm(total=len(todo) * SHARD_WINDOWS, desc="target features", unit="window") as bar:
        for index in todo:
            ids = torch.tensor(batches[index], dtype=torch.int64)  # [W, T]
            features, final, top = [], [], []
            for row in ids:
                with torch.inference_mode(), tap.recording():
                    target.model(input_ids=row[None])
                    rows = tap.rows().view(ids.shape[1], len(tapped), width)  # [T, tapped, H]
                    top.append(lm_head(rows[:, tapped.index(num_layers)]).argmax(-1).to(torch.int32))  # [T]
                features.append(rows[:, [tapped.index(layer) for layer in layers]].flatten(1).to(torch.bfloat16))
                final.append(rows[:, tapped.index(num_layers)].to(torch.bfloat16))
                bar.update(1)
            shard = {"ids": ids.to(torch.int32), "features": torch.stack(features), "final": torch.stack(final)}
            shard["top"] = torch.stack(top)  # [W, T]: the target's greedy next token over its whole vocabulary
            torch.save(shard, paths[index].with_suffix(".tmp"))
            paths[index].with_suffix(".tmp").rename(paths[index])


def _chunks(stream: Iterator[list[int]], size: int) -> Iterator[list[list[int]]]:
    chunk: list[list[int]] = []
    for item in stream:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []


def draft_vocabulary(paths: list[Path], size: int, vocab: int, keep: tuple[int, ...]) -> torch.Tensor:
    """The `size` most frequent target ids of the data (and `keep`, the end tokens), ascending. [Vd]"""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for path in paths:
        counts += torch.bincount(torch.load(path)["ids"].flatten().to(torch.int64), minlength=vocab)[:vocab]
    for token in keep:
        counts[token] = counts.max() + 1
    return counts.topk(min(size, vocab)).indices.sort().values
