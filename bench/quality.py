"""How much int8 changes the target: perplexity of the float32 and the int8 target on a fixed
text, and how often their greedy choices agree. `python -m bench.quality [--threads N]`.

The text is CPython 3.11's `textwrap.py` (PSF licence), committed beside this file as
`quality_text.py.txt` so every machine scores the same tokens: code with long docstrings,
the kind of text the Qwen2.5-Coder pair serves. Scored in windows of `--window` tokens, each
window's first half as context only after the first (a sliding window: every token but the
first is scored once, with at least half a window of context).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.engine.quantize import quantize_int8
from specdec.tools.real_models import TARGET

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / ".cache/models"
TEXT = HERE / "quality_text.py.txt"


@torch.inference_mode()
def score(model, ids: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored position: the log-probability of the true next token and the argmax.
    ids: [N] → ([N - 1], [N - 1])"""
    logprobs, argmax = [], []
    stride = window // 2
    start = 0
    while start + 1 < len(ids):
        context = 0 if start == 0 else stride
        chunk = ids[max(0, start - context) : start + window - context]  # [W]
        logits = model(input_ids=chunk[None]).logits[0, :-1].float()  # [W - 1, V]
        targets = chunk[1:]
        keep = slice(context - 1 if context else 0, None)  # positions whose next token is new
        lp = torch.log_softmax(logits[keep], dim=-1)
        logprobs.append(lp.gather(1, targets[keep, None])[:, 0])
        argmax.append(logits[keep].argmax(-1))
        start += window - context
    return torch.cat(logprobs)[: len(ids) - 1], torch.cat(argmax)[: len(ids) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = MODELS / TARGET.name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(TEXT.read_text())["input_ids"][: args.max_tokens])  # [N]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = {}
    for name in ("float32", "int8"):
        if name == "int8":
            quantize_int8(model)
        started = time.perf_counter()
        results[name] = score(model, ids, args.window)
        print(f"{name}: scored {len(results[name][0])} tokens in {time.perf_counter() - started:.0f} s")
    ppl = {name: math.exp(-float(lp.mean())) for name, (lp, _) in results.items()}
    agree = float((results["float32"][1] == results["int8"][1]).float().mean())
    print(f"\n{TARGET.name} on {TEXT.name} ({len(ids)} tokens, window {args.window}):")
    print("| target | perplexity |\n|---|---|")
    for name, value in ppl.items():
        print(f"| {name} | {value:.3f} |")
    print(
        f"\nint8 / float32 perplexity: {ppl['int8'] / ppl['float32']:.4f} "
        f"({100 * (ppl['int8'] / ppl['float32'] - 1):+.2f}%)"
    )
    print(f"greedy agreement (same argmax at a position, teacher-forced): {100 * agree:.2f}%")


if __name__ == "__main__":
    main()
