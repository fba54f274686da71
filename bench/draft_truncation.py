"""What truncating the draft's distribution to its top k costs in acceptance.

A sampled round ships each draft token's distribution to the target; dense, that is 151,936
float32 values (0.6 MB) per token. The draft can instead sample from its own distribution
truncated to its top k and ship that sparsely: still exact, since it is the distribution the
token was drawn from. The price is acceptance: a draft token is accepted with probability
Σ_x min(target_probs(x), draft_probs(x)), and truncation moves draft_probs. This scores both
on a fixed text (teacher-forced: each position's distributions given the true prefix), with
the real pair as the services run it (int8 draft and int8 target), at a few temperatures.

    python -m bench.draft_truncation [--top-k 64 256 1024] [--temperatures 0.7 1.0]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.quality import MODELS, TEXT
from specdec.engine.quantize import quantize_int8
from specdec.sampling.probs import SamplingParams, logits_to_probs, truncate_top_k
from specdec.tools.real_models import DRAFT, TARGET


@torch.inference_mode()
def logits_of(folder, ids: torch.Tensor) -> torch.Tensor:
    model = quantize_int8(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return model(input_ids=ids[None]).logits[0].float()  # [N, V]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-k", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / TARGET.name)
    ids = torch.tensor(tokenizer(TEXT.read_text())["input_ids"][: args.tokens])
    target_logits, draft_logits = logits_of(MODELS / TARGET.name, ids), logits_of(MODELS / DRAFT.name, ids)
    width = min(target_logits.shape[-1], draft_logits.shape[-1])
    print(f"mean acceptance probability per draft token over {len(ids)} positions of {TEXT.name}:")
    print("| temperature | full draft distribution | " + " | ".join(f"top-{k}" for k in args.top_k) + " |")
    print("|---|---|" + "---|" * len(args.top_k))
    for temperature in args.temperatures:
        params = SamplingParams(temperature=temperature)
        target_probs = logits_to_probs(target_logits[:, :width], params)  # [N, V]
        draft_probs = logits_to_probs(draft_logits[:, :width], params)  # [N, V]
        cells = [float(torch.minimum(target_probs, draft_probs).sum(-1).mean())]
        for k in args.top_k:
            cells.append(float(torch.minimum(target_probs, truncate_top_k(draft_probs, k)).sum(-1).mean()))
        print(f"| {temperature} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
