"""Conversations for training an EAGLE head (specdec.tools.train_head --conversations N): prompts
written from text any machine has, answered by the target itself.

The prompts never come from the benchmark. They are made from the Python standard library:
its public functions' and modules' one-line docstrings become requests to write, explain or
use them (chat-formatted with the target's own template), and short story openers, put
together from word lists, are continued as plain text. The target answers each with its own
sampled continuation, so the head learns the target's distribution where it will serve it
(an answer's text, not the library's source)."""

from __future__ import annotations

import ast
import functools
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

SYSTEMS = (
    "You are a helpful assistant.",
    "You are a helpful coding assistant.",
    "You are a concise assistant who answers programming questions with short examples.",
)
FUNCTION_REQUESTS = (
    "Write a Python function `{name}({params})` that does the following: {summary}",
    "Explain what `{module}.{name}` does in Python, and show when you would use it.",
    "How would I do this in Python: {summary_lower} Give a short example.",
    "Implement `{name}({params})` from scratch without importing `{module}`. It should: {summary_lower}",
)
MODULE_REQUESTS = (
    "Give a short overview of the Python `{module}` module ({summary_lower_bare}) with an example.",
    "What is the `{module}` module in Python's standard library for? {summary}",
)
SUBJECTS = (
    "The young engineer",
    "An old fisherman",
    "The night-shift nurse",
    "A retired teacher",
    "The ship's cook",
    "Her grandmother",
    "The new mayor",
    "A tired courier",
    "The museum guard",
    "Two children",
)
EVENTS = (
    "opened the letter",
    "heard the bell ring twice",
    "found the door unlocked",
    "missed the last train",
    "saw the lights go out",
    "counted the coins again",
    "noticed the map was wrong",
    "smelled smoke",
)
PLACES = (
    "in the empty station",
    "at the edge of the harbor",
    "in the back of the bakery",
    "on the frozen road",
    "behind the old library",
    "at the top of the hill",
    "in the crowded market",
    "beside the river",
)


@functools.lru_cache(maxsize=None)
def _documented(path: Path) -> tuple[tuple[str, str, str, str], ...]:
    """(module, name, params, summary) of a stdlib file's public functions with a one-line
    summary; name and params are "" for the module's own docstring. Kept: parsing the whole
    standard library takes seconds, and its files do not change under a running process."""
    return tuple(_summaries(path))


def _summaries(path: Path) -> Iterator[tuple[str, str, str, str]]:
    module = path.with_suffix("").name
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in [tree, *tree.body]:
        if isinstance(node, ast.Module):
            name, params = "", ""
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            name, params = node.name, ", ".join(arg.arg for arg in node.args.args if arg.arg != "self")
        else:
            continue
        doc = ast.get_docstring(node)
        summary = doc.strip().splitlines()[0].strip() if doc else ""
        if 25 <= len(summary) <= 120 and summary.endswith(".") and summary[0].isupper():
            yield module, name, params, summary


def prompts(tokenizer, stdlib: list[Path], count: int, seed: int) -> list[str]:
    """`count` prompt texts, seeded: about four in five chat-formatted requests about the
    standard library's files `stdlib` (head_data.corpus_files), one in five story openers to
    continue."""
    skip = {"test", "tests", "idlelib", "lib2to3", "turtledemo"}
    items = [item for path in stdlib if not skip.intersection(path.parts) for item in _documented(path)]
    rng = random.Random(seed)
    rng.shuffle(items)
    made: list[str] = []
    for index in range(count):
        if index % 5 == 4:
            made.append(f"{rng.choice(SUBJECTS)} {rng.choice(EVENTS)} {rng.choice(PLACES)}, and")
            continue
        module, name, params, summary = items[index % len(items)]
        fields = {
            "module": module,
            "name": name,
            "params": params,
            "summary": summary,
            "summary_lower": summary[0].lower() + summary[1:],
            "summary_lower_bare": (summary[0].lower() + summary[1:]).rstrip("."),
        }
        request = rng.choice(FUNCTION_REQUESTS if name else MODULE_REQUESTS).format(**fields)
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": request}]
        made.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return made


def answered(
    target, tokenizer, texts: list[str], new_tokens: int, batch: int, temperature: float, seed: int, path: Path
) -> list[list[int]]:
    """Each prompt's tokens followed by the target's sampled answer (up to `new_tokens`, ending
    at its end token), `batch` prompts at a time; kept in `path` after each batch, so a stopped
    run answers only the rest. Batch b draws from seed + b."""
    done: list[list[int]] = torch.load(path) if path.is_file() else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = {token for token in [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")] if token}
    with tqdm(total=len(texts), initial=len(done), desc="target answers", unit="prompt") as bar:
        for start in range(len(done), len(texts), batch):
            encoded = [tokenizer(text, add_special_tokens=False).input_ids for text in texts[start : start + batch]]
            longest = max(len(ids) for ids in encoded)
            ids = torch.tensor([[pad] * (longest - len(row)) + row for row in encoded])  # left-padded [B, P]
            mask = torch.tensor([[0] * (longest - len(row)) + [1] * len(row) for row in encoded])
            torch.manual_seed(seed + start // batch)
            with torch.inference_mode():
                out = target.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    pad_token_id=pad,
                    eos_token_id=sorted(ends),
                )
            for row, prompt in zip(out[:, longest:].tolist(), encoded):
                answer = []
                for token in row:
                    answer.append(token)
                    if token in ends:
                        break
                done.append(prompt + answer)
            torch.save(done, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            bar.update(len(encoded))
    return done[: len(texts)]  # a folder answered for more prompts than asked now: the first ones


def cut(sequences: list[list[int]], seq_len: int, eos: int | None) -> list[list[int]]:
    """The sequences one after another (an end token between them), in windows of `seq_len`
    tokens; the tail that fills no window is left out."""
    stream: list[int] = []
    for sequence in sequences:
        stream += sequence + ([eos] if eos is not None and sequence[-1:] != [eos] else [])
    return [stream[start : start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]
