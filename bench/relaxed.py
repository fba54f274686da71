"""`--suite relaxed` (also `python -m bench.relaxed`): what relaxed acceptance buys and what it
costs, with the real pair by default (any pair through --draft-model and --target-model).

Relaxed output is not the target's (docs/design.md, Relaxed acceptance); this suite measures by
how much, side by side with the speed it buys. One stack (draft, target and coordinator as
processes; the int8 draft, the target as --target-setting picks), one greedy request at a time,
every mode on each prompt before the next prompt, the whole set --repeats times for the
timings:
- target-only (K = 0): the target's own greedy output;
- exact, K = the last of --ks (default 4);
- relaxed at each (top_n, delta) of SETTINGS, the same K.

Reported for each mode: tokens per second over all its requests, against exact and against
target-only; acceptance and tokens per round, and the share of accepted drafts only the relaxed
rule kept; agreement with the exact output (the tokens before the first divergence, as a share
of the exact output's, and how many outputs are identical); and the perplexity of its output
under the target (the checkpoint loaded in this process with transformers once the services
have stopped: float32, or bfloat16 on a GPU), pooled over the prompts, exact's beside it.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.harness import load_prompts, machine_info, parse_args
from bench.modes import BenchConfig, pair_stack
from specdec.sampling.relaxed import DEFAULT_DELTA, DEFAULT_TOP_N
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

logger = logging.getLogger("bench")

# (top_n, delta): stricter than the default, the default, looser.
SETTINGS = ((2, 0.1), (DEFAULT_TOP_N, DEFAULT_DELTA), (5, 0.5))
TARGET_ONLY = "target-only (K=0)"


@dataclass(frozen=True)
class RelaxedMode:
    name: str
    k: int
    top_n: int = 0  # 0: exact
    delta: float = 0.0

    def request_fields(self) -> dict:
        if not self.top_n:
            return {"num_speculative_tokens": self.k, "acceptance_mode": "exact"}
        return {
            "num_speculative_tokens": self.k,
            "acceptance_mode": "relaxed",
            "relaxed_top_n": self.top_n,
            "relaxed_delta": self.delta,
        }


def build_modes(k: int) -> list[RelaxedMode]:
    return [
        RelaxedMode(TARGET_ONLY, 0),
        RelaxedMode(exact_name(k), k),
        *(RelaxedMode(f"relaxed N={top_n} δ={delta:g}", k, top_n, delta) for top_n, delta in SETTINGS),
    ]


def exact_name(k: int) -> str:
    return f"exact K={k}"


def generate(stub, prompt_ids: list[int], mode: RelaxedMode, max_new_tokens: int) -> dict:
    response = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, **mode.request_fields()),
        timeout=1800,
    )
    s = response.stats
    return {
        "mode": mode.name,
        "token_ids": list(response.token_ids),
        "text": response.text,
        "tokens": s.generated_tokens,
        "total_ms": s.total_ms,
        "rounds": s.rounds,
        "proposed": s.proposed_tokens,
        "accepted": s.accepted_tokens,
        "relaxed_accepted": s.relaxed_accepted_tokens,
        "acceptance_mode": s.acceptance_mode,
    }


def run_relaxed(config: BenchConfig, machine: dict) -> dict:
    prompts = load_prompts(config)
    tokenizer = AutoTokenizer.from_pretrained(config.target_model)
    prompt_ids = [list(tokenizer(prompt["text"])["input_ids"]) for prompt in prompts]
    k = config.ks[-1]
    modes = build_modes(k)
    samples: list[dict] = []
    with pair_stack(config, config.out_dir / "logs") as services:
        with grpc.insecure_channel(services["coordinator"].address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for mode in modes:  # warm-up: first calls pay one-off costs
                generate(stub, prompt_ids[0], mode, 4)
            for repeat in range(config.repeats):
                for index, ids in enumerate(prompt_ids):
                    for mode in modes:
                        sample = generate(stub, ids, mode, config.max_new_tokens)
                        sample.update(prompt=index, kind=prompts[index]["kind"], repeat=repeat)
                        samples.append(sample)
                        print(
                            f"{prompts[index]['kind']} [{repeat}] {mode.name}: {sample['tokens']} tokens, "
                            f"{sample['tokens'] / sample['total_ms'] * 1e3:.2f} tok/s, "
                            f"{sample['accepted']}/{sample['proposed']} accepted "
                            f"({sample['relaxed_accepted']} by the relaxed rule alone)",
                            flush=True,
                        )
    logger.info("scoring every output under the target in this process")
    return {
        "suite": "relaxed",
        "machine": machine,
        "config": {
            "k": k,
            "max_new_tokens": config.max_new_tokens,
            "repeats": config.repeats,
            "settings": [list(setting) for setting in SETTINGS],
            "target_model": str(config.target_model),
        },
        "prompts": [prompt["kind"] for prompt in prompts],
        "modes": [mode.name for mode in modes],
        "samples": samples,
        "scores": score_outputs(config, prompt_ids, samples),
    }


def score_outputs(config: BenchConfig, prompt_ids: list[list[int]], samples: list[dict]) -> list[dict]:
    """Each (prompt, mode)'s first output scored by the target: the sum of the generated tokens'
    negative log-likelihoods (nats) and their count, so perplexities pool over prompts."""
    dtype = torch.float32 if config.device == "cpu" else torch.bfloat16
    loaded: Any = AutoModelForCausalLM.from_pretrained(config.target_model, dtype=dtype)
    model = loaded.to(config.device).eval()
    scores = []
    for sample in samples:
        if sample["repeat"]:
            continue
        prompt, output = prompt_ids[sample["prompt"]], sample["token_ids"]
        nll = sequence_nll(model, prompt, output, config.device) if output else 0.0
        scores.append({"prompt": sample["prompt"], "mode": sample["mode"], "nll": nll, "tokens": len(output)})
    return scores


def sequence_nll(model, prompt: list[int], output: list[int], device: str) -> float:
    """−Σ log p_target(output_j | prompt, output_<j), in one forward pass."""
    ids = torch.tensor([prompt + output], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [N, V]: the rows predicting each output token
    log_probs = torch.log_softmax(logits, dim=-1)
    return float(-log_probs.gather(-1, torch.tensor(output, device=device)[:, None]).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summarise(results: dict) -> list[dict]:
    """One row per mode, every ratio within this run."""
    samples, k = results["samples"], results["config"]["k"]
    reference = {s["prompt"]: s["token_ids"] for s in samples if s["mode"] == exact_name(k) and s["repeat"] == 0}

    def rate(mode: str) -> float:
        chosen = [s for s in samples if s["mode"] == mode]
        return sum(s["tokens"] for s in chosen) / sum(s["total_ms"] for s in chosen) * 1e3

    rows = []
    for mode in results["modes"]:
        chosen = [s for s in samples if s["mode"] == mode]
        first = [s for s in chosen if s["repeat"] == 0]
        scores = [score for score in results["scores"] if score["mode"] == mode]
        proposed, accepted = sum(s["proposed"] for s in chosen), sum(s["accepted"] for s in chosen)
        tokens_scored = sum(score["tokens"] for score in scores)
        rows.append(
            {
                "mode": mode,
                "tokens_per_s": rate(mode),
                "vs_exact": rate(mode) / rate(exact_name(k)),
                "vs_target_only": rate(mode) / rate(TARGET_ONLY),
                "acceptance": accepted / proposed if proposed else None,
                "tokens_per_round": sum(s["tokens"] for s in chosen) / max(1, sum(s["rounds"] for s in chosen)),
                "relaxed_only_share": sum(s["relaxed_accepted"] for s in chosen) / accepted if accepted else 0.0,
                "prefix_agreement": statistics.mean(
                    common_prefix(s["token_ids"], reference[s["prompt"]]) / max(1, len(reference[s["prompt"]]))
                    for s in first
                ),
                "identical": sum(s["token_ids"] == reference[s["prompt"]] for s in first),
                "outputs": len(first),
                "perplexity": math.exp(sum(score["nll"] for score in scores) / tokens_scored)
                if tokens_scored
                else None,
                "labelled": sorted({s["acceptance_mode"] for s in chosen}),
            }
        )
    return rows


def markdown(results: dict) -> str:
    rows = results["summary"] = summarise(results)  # from the samples, never a stale copy
    machine, config = results["machine"], results["config"]
    lines = [
        f"Relaxed acceptance (`--suite relaxed`), {machine['date']}: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine.get('gpu') or 'no GPU'}; torch {machine['torch']}; target {config['target_model']} "
        f"({machine.get('target_setting', '')}). Greedy, K = {config['k']}, at most {config['max_new_tokens']} tokens, "
        f"{len(results['prompts'])} prompts × {config['repeats']} repeats, one request at a time, the modes "
        "interleaved. Relaxed output is not the target's: agreement and perplexity say by how much.",
        "",
        "| mode | tok/s | vs exact | vs target-only | acceptance | tokens/round | accepted by the relaxed rule "
        "alone | tokens before the first divergence from exact | identical to exact | perplexity under the target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        acceptance = "–" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        perplexity = "–" if row["perplexity"] is None else f"{row['perplexity']:.3f}"
        lines.append(
            f"| {row['mode']} | {row['tokens_per_s']:.2f} | {row['vs_exact']:.2f}× | {row['vs_target_only']:.2f}× | "
            f"{acceptance} | {row['tokens_per_round']:.2f} | {row['relaxed_only_share']:.0%} | "
            f"{row['prefix_agreement']:.0%} | {row['identical']} of {row['outputs']} | {perplexity} |"
        )
    lines += [
        "",
        "Perplexity: exp of the mean negative log-likelihood of the generated tokens under the target checkpoint "
        "(in the bench process: float32 on CPU, bfloat16 on a GPU), pooled over the prompts; the exact greedy "
        "output's is the one to compare with. Agreement: the mean over prompts of the tokens before the first "
        "divergence from the exact output, as a share of the exact output's length.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.relaxed ARGS`: `python -m bench --suite relaxed ARGS` (any --suite given is ignored)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args([*(sys.argv[1:] if argv is None else argv), "--suite", "relaxed"])
    results = run_relaxed(config, machine_info(config))
    table = markdown(results)
    out: Path = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table)
    print("\n" + table)
    print(f"results: {out}/results.json, table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
