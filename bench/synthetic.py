"""A tiny model pair whose draft agrees with the target at a chosen rate.

The accelerator suite needs pairs with α (the chance that the draft's greedy token is the
target's) of about 0.6, 0.8 and 0.9, reproducibly. The target is a random tiny Qwen2 (the
tests' byte-level tokenizer, 320 ids); the draft is a copy of it with noise added to every
weight (specdec.tools.testing.build_model). More noise, less agreement: a bisection on the
noise finds the level that gives the chosen α, measured the way greedy rounds meet it: along
the target's own greedy continuations of the suite's prompts, how often a round of K = 4 has
its first draft accepted (disagreements cluster, so this is lower than the plain share of
positions where the two argmaxes agree).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specdec.tools.testing import TinyPair, build_model, byte_level_tokenizer

PROMPTS = [[5, 17, 99], [40, 41, 42, 43], [250, 3], [120, 77, 77, 1]]  # the accelerator suite's
MEASURE_TOKENS = 128
K = 4
MAX_CONTEXT = 2048


def greedy_agreement(target_dir: Path, draft_dir: Path) -> float:
    """α for greedy chain rounds of K: along the target's greedy path, rounds start after each
    round's last committed token; the share of them whose first draft (the draft's argmax given
    the target's prefix) is the target's token."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    accepted = rounds = 0
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            path = target.generate(ids, max_new_tokens=MEASURE_TOKENS, do_sample=False, pad_token_id=0)  # [1, P + N]
            target_next = target(path).logits[0, len(prompt) - 1 : -1].argmax(-1)  # [N]
            draft_next = draft(path).logits[0, len(prompt) - 1 : -1].argmax(-1)  # [N]
            agrees = (target_next == draft_next).tolist()
            position = 0
            while position < len(agrees):
                run = 0
                while run < K and position + run < len(agrees) and agrees[position + run]:
                    run += 1
                rounds += 1
                accepted += run > 0
                position += run + 1  # the accepted drafts and the recovered or bonus token
    return accepted / rounds


def pair_with_acceptance(root: Path, alpha: float, tolerance: float = 0.03) -> tuple[TinyPair, float]:
    """The pair under `root/alpha-<α>` (built once, then reused) and its measured α. Processes
    that ask at once (test workers) wait for one build: it runs under a lock, in a folder of
    its own that is renamed into place whole, so no reader sees a draft being rebuilt."""
    folder = root / f"alpha-{alpha:.2f}"
    tokenizer = byte_level_tokenizer()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".alpha-{alpha:.2f}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "alpha.json").exists():
            building = root / f".building-{alpha:.2f}-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            _build(building, tokenizer, alpha, tolerance)
            shutil.rmtree(folder, ignore_errors=True)  # a build that died before its record
            os.rename(building, folder)
    pair = TinyPair(folder / "target", folder / "draft", len(tokenizer), None)
    return pair, json.loads((folder / "alpha.json").read_text())["measured"]


def _build(folder: Path, tokenizer, alpha: float, tolerance: float) -> None:
    """A target and a draft whose noise is bisected until the draft's greedy agreement is α."""
    record = folder / "alpha.json"
    pair = TinyPair(folder / "target", folder / "draft", len(tokenizer), None)
    target = build_model(
        folder / "target", tokenizer, seed=0, logit_scale=3.0, eos_token_id=None, max_context=MAX_CONTEXT
    )
    low, high = 0.0, 1.0  # noise: agreement falls as it grows
    measured, noise = 1.0, 0.0
    for _ in range(12):
        noise = (low + high) / 2
        build_model(
            folder / "draft", tokenizer, seed=1, logit_scale=1.0, eos_token_id=None, base=target, noise=noise,
            max_context=MAX_CONTEXT,
        )  # fmt: skip
        measured = greedy_agreement(pair.target, pair.draft)
        if abs(measured - alpha) <= tolerance:
            break
        low, high = (noise, high) if measured > alpha else (low, noise)
    record.write_text(json.dumps({"target": alpha, "measured": measured, "noise": noise}))
