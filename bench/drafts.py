"""`--suite drafts`: which draft pays for the Qwen2.5-Coder-1.5B target on this machine
(issue 38): the same-family 0.5B against SmolLM2-135M, a draft of another family that
drafts within the tokens its vocabulary shares with Qwen's (--target-tokenizer).

Each draft runs in its own stack (draft service, int8 target service, coordinator), one stack
after another; in each, every prompt runs with K = 0 (target-only through the same services),
K = 4 fixed (acceptance on equal terms) and the coordinator's own choice, greedy and sampled,
interleaved. Prompts: `make run`'s three chat questions and the bench's five prompt kinds.
Then Hugging Face in this process, the peer a user has: target-only, assisted generation with
the 0.5B, and universal assisted generation (another tokenizer) with SmolLM2.

Needs `make models MODELS_EXTRA=smollm2`.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import grpc
import torch

from bench.demo_prompts import QUESTIONS, SYSTEM
from bench.modes import ROOT, model_infos, pair_stack
from specdec.engine.quantize import quantize_int8
from specdec.tools.real_models import DRAFT, SMOLLM2
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

DRAFTS = {  # stack name: (model folder name, whether it needs --target-tokenizer)
    "qwen2.5-0.5b": (DRAFT.name, False),
    "smollm2-135m": (SMOLLM2.name, True),
}
KS: tuple[int | None, ...] = (0, 4, None)  # None: the coordinator chooses
TEMPERATURES = (0.0, 0.7)
SEED = 7
# The model alone, no prompt lookup: acceptance and c are then the drafts' own (make run's
# hybrid copies where the text repeats itself, the same in either stack).
DRAFTER = "model"


def prompts() -> list[dict]:
    """make run's chat questions (with its system prompt), then the bench's prompt kinds."""
    out = [{"kind": "demo", "messages": [("system", SYSTEM), ("user", q)]} for q in QUESTIONS]
    for item in json.loads((ROOT / "bench" / "prompts.json").read_text())["prompts"]:
        out.append({"kind": item["kind"], "text": item["text"]})
    return out


def request(prompt: dict, k: int | None, temperature: float, max_new_tokens: int) -> pb.GenerateRequest:
    fields: dict = dict(max_new_tokens=max_new_tokens, num_speculative_tokens=k, temperature=temperature)
    if temperature:
        fields["seed"] = SEED
    if "messages" in prompt:
        fields["messages"] = [pb.ChatMessage(role=role, content=content) for role, content in prompt["messages"]]
    else:
        fields["prompt"] = prompt["text"]
    return pb.GenerateRequest(**fields)


def run_stack(name: str, config, logs: Path) -> tuple[list[dict], dict]:
    folder, bridged = DRAFTS[name]
    draft_model = config.draft_model.parent / folder
    if not draft_model.exists():
        raise SystemExit(f"{draft_model} is missing: run `make models MODELS_EXTRA=smollm2` first")
    extra = ["--target-tokenizer", str(config.target_model)] if bridged else []
    samples: list[dict] = []
    with pair_stack(
        config, logs / name, draft_model=draft_model, draft_args=["--drafter", DRAFTER, *extra]
    ) as services:
        infos = model_infos(services["draft"], services["target"], timeout=10)
        draft_info, target_info = infos["draft"], infos["target"]
        info = {
            "draft_pass_ms": list(draft_info.calibrated_pass_ms),
            "target_pass_ms": list(target_info.calibrated_pass_ms),
            "shared_tokens": draft_info.vocab_bridge.shared_tokens,
            "target_vocab_tokens": draft_info.vocab_bridge.target_vocab_tokens,
        }
        with grpc.insecure_channel(services["coordinator"].address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            stub.Generate(request(prompts()[0], None, 0.0, 4), timeout=600)  # warm-up
            for index, prompt in enumerate(prompts()):
                for temperature in TEMPERATURES:
                    for k in KS:
                        started = time.perf_counter()
                        response = stub.Generate(request(prompt, k, temperature, config.max_new_tokens), timeout=900)
                        s = response.stats
                        sample = {
                            "stack": name,
                            "kind": prompt["kind"],
                            "index": index,
                            "temperature": temperature,
                            "k": k,
                            "token_ids": list(response.token_ids),
                            "tokens": s.generated_tokens,
                            "total_ms": s.total_ms,
                            "wall_ms": (time.perf_counter() - started) * 1e3,
                            "proposed": s.proposed_tokens,
                            "accepted": s.accepted_tokens,
                            "rounds": s.rounds,
                            "copied_rounds": s.copied_rounds,
                        }
                        samples.append(sample)
                        print(
                            f"{name} {prompt['kind']}[{index}] T={temperature} K={'chosen' if k is None else k}: "
                            f"{s.generated_tokens} tokens, {s.generated_tokens / s.total_ms * 1e3:.1f} tok/s, "
                            f"accepted {s.accepted_tokens}/{s.proposed_tokens}",
                            flush=True,
                        )
    return samples, info


def run_hf(config) -> list[dict]:
    """transformers in this process: target-only, assisted with the int8 0.5B, and universal
    assisted generation (another tokenizer) with the int8 SmolLM2; the same prompts, rendered
    with the target's chat template, and the same int8 target layers as the service's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(config.target_model)
    target = quantize_int8(AutoModelForCausalLM.from_pretrained(config.target_model, dtype=torch.float32).eval())
    smol_dir = config.draft_model.parent / SMOLLM2.name

    def smol():
        model = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
        quantize_int8(model.model)  # its body only: transformers cuts a float output head itself
        return model

    # One per mode: sampled, transformers cuts the assistant's head to the shared tokens in
    # place, which its greedy path (another algorithm) then cannot use.
    smol_for = {False: smol(), True: smol()}
    assistants = {
        "hf-assisted qwen2.5-0.5b": (
            quantize_int8(AutoModelForCausalLM.from_pretrained(config.draft_model.parent / DRAFT.name).eval()),
            None,
        ),
        "hf-universal smollm2-135m": (None, AutoTokenizer.from_pretrained(smol_dir)),
    }
    # Warm up each mode, as the service stacks' warm-up request does: its first call pays the
    # int8 kernels' and allocations' first-time costs, which would count against it.
    warm = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    for temperature in TEMPERATURES:
        for mode, (assistant, assistant_tokenizer) in {"hf target-only": (None, None), **assistants}.items():
            extra: dict = {"do_sample": temperature > 0}
            if mode != "hf target-only":
                extra["assistant_model"] = assistant or smol_for[temperature > 0]
                if assistant_tokenizer is not None:
                    extra.update(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
            with torch.inference_mode(), contextlib.suppress(Exception):  # a refusal shows in the run
                target.generate(warm, max_new_tokens=8, **extra)  # type: ignore[operator]
    samples = []
    for index, prompt in enumerate(prompts()):
        if "messages" in prompt:
            text = tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in prompt["messages"]], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt["text"]
        ids = tokenizer(text, return_tensors="pt").input_ids
        for temperature in TEMPERATURES:
            for mode in ("hf target-only", *assistants):
                kwargs: dict = dict(max_new_tokens=config.max_new_tokens, do_sample=temperature > 0)
                if temperature:
                    kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
                    torch.manual_seed(SEED)
                if mode in assistants:
                    assistant, assistant_tokenizer = assistants[mode]
                    kwargs["assistant_model"] = assistant or smol_for[temperature > 0]
                    if assistant_tokenizer is not None:
                        kwargs.update(tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
                started = time.perf_counter()
                try:
                    with torch.inference_mode():
                        out = target.generate(ids, **kwargs)  # type: ignore[operator]
                except Exception as exc:  # noqa: BLE001 - a peer's limitation is a result, not a crash
                    print(f"{mode} T={temperature}: {type(exc).__name__}: {exc}", flush=True)
                    samples.append({"stack": mode, "index": index, "temperature": temperature, "error": str(exc)[:300]})
                    continue
                total_ms = (time.perf_counter() - started) * 1e3
                new = out[0, ids.shape[1] :].tolist()
                samples.append(
                    {
                        "stack": mode,
                        "kind": prompt["kind"],
                        "index": index,
                        "temperature": temperature,
                        "token_ids": new,
                        "tokens": len(new),
                        "total_ms": total_ms,
                    }
                )
                print(f"{mode} {prompt['kind']}[{index}] T={temperature}: {len(new) / total_ms * 1e3:.1f} tok/s")
    return samples


def run_drafts(config, machine: dict) -> dict:
    logs = config.out_dir / "logs"
    samples: list[dict] = []
    infos = {}
    for name in DRAFTS:
        stack_samples, infos[name] = run_stack(name, config, logs)
        samples += stack_samples
    samples += run_hf(config)
    return {
        "suite": "drafts",
        "machine": machine,
        "max_new_tokens": config.max_new_tokens,
        "drafter": DRAFTER,
        "info": infos,
        "samples": samples,
    }


def _rate(samples: list[dict]) -> float:
    return sum(s["tokens"] for s in samples) / sum(s["total_ms"] for s in samples) * 1e3 if samples else float("nan")


def summarise(results: dict) -> dict:
    samples = [s for s in results["samples"] if "error" not in s]
    rows = {}
    for temperature in TEMPERATURES:
        for name in DRAFTS:
            pick = [s for s in samples if s["stack"] == name and s["temperature"] == temperature]
            base = [s for s in pick if s["k"] == 0]
            reference = {s["index"]: s["token_ids"] for s in base}
            base_rate = {s["index"]: _rate([s]) for s in base}  # each prompt's own target-only
            info = results["info"][name]
            row: dict = {
                "c": info["draft_pass_ms"][0] / info["target_pass_ms"][0] if info["draft_pass_ms"] else float("nan"),
                "draft_ms": info["draft_pass_ms"][0] if info["draft_pass_ms"] else float("nan"),
                "target_ms": info["target_pass_ms"][0] if info["target_pass_ms"] else float("nan"),
                "target_only": _rate(base),
            }
            for k in (4, None):
                chosen = [s for s in pick if s["k"] == k]
                label = "chosen" if k is None else f"k{k}"
                row[f"{label} tok/s"] = _rate(chosen)
                row[f"{label} acceptance"] = sum(s["accepted"] for s in chosen) / max(
                    1, sum(s["proposed"] for s in chosen)
                )
                rounds = max(1, sum(s["rounds"] for s in chosen))
                row[f"{label} tokens/round"] = sum(s["tokens"] for s in chosen) / rounds
                row[f"{label} identical"] = sum(s["token_ids"] == reference[s["index"]] for s in chosen)
                row[f"{label} demo tok/s"] = [
                    s["tokens"] / s["total_ms"] * 1e3 for s in chosen if s["kind"] == "demo"
                ]  # make run's prompts, one by one
                row[f"{label} demo ratio"] = [  # ... each over its own target-only run, as make run prints it
                    _rate([s]) / base_rate[s["index"]]
                    for s in chosen
                    if s["kind"] == "demo" and s["index"] in base_rate
                ]
            row["requests"] = len(base)
            rows[f"{name} T={temperature}"] = row
        hf = [s for s in samples if s["stack"].startswith("hf") and s["temperature"] == temperature]
        hf_base = _rate([s for s in hf if s["stack"] == "hf target-only"])
        rows[f"hf T={temperature}"] = {
            mode: _rate([s for s in hf if s["stack"] == mode]) / hf_base for mode in sorted({s["stack"] for s in hf})
        }
        rows[f"hf T={temperature}"]["target_only"] = hf_base
    errors = sorted({(s["stack"], s["temperature"], s["error"]) for s in results["samples"] if "error" in s})
    return {"rows": rows, "errors": [list(e) for e in errors]}


def markdown(results: dict) -> str:
    summary = results["summary"] = summarise(results)  # from the samples, never a stale copy
    machine, rows = results["machine"], summary["rows"]
    smol = results["info"]["smollm2-135m"]
    lines = [
        f"Which draft pays (`--suite drafts`), {machine['date']}: {machine['cpu']} ({machine['cpu_flags']}), "
        f"{machine['cores']} cores, no GPU; torch {machine['torch']}. Target Qwen2.5-Coder-1.5B "
        f"({machine.get('target_setting', 'as --target-setting')}); both drafts int8, `--drafter "
        f"{results['drafter']}`; SmolLM2 drafts within the {smol['shared_tokens']:,} tokens it shares with "
        f"Qwen's tokenizer ({smol['shared_tokens'] / max(1, smol['target_vocab_tokens']):.1%} of "
        f"{smol['target_vocab_tokens']:,}). {rows['qwen2.5-0.5b T=0.0']['requests']} "
        f"prompts (make run's 3 chat questions, the bench's 5 kinds), at most {results['max_new_tokens']} tokens, "
        "one request at a time; sampled at T = 0.7 with one seed.",
        "",
        "| draft | T | draft step | c | acceptance (K=4) | tokens/round (K=4) | target-only | K=4 | chosen K | "
        "greedy identical | make run prompts, chosen ÷ target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for temperature in TEMPERATURES:
        for name in DRAFTS:
            row = rows[f"{name} T={temperature}"]
            base = row["target_only"]
            demo = ", ".join(f"{ratio:.2f}×" for ratio in row["chosen demo ratio"])
            identical = (
                f"{row['k4 identical']}/{row['requests']}, {row['chosen identical']}/{row['requests']}"
                if not temperature
                else "n/a"
            )
            lines.append(
                f"| {name} | {temperature} | {row['draft_ms']:.1f} ms | {row['c']:.2f} | {row['k4 acceptance']:.2f} | "
                f"{row['k4 tokens/round']:.2f} | {base:.1f} tok/s | {row['k4 tok/s'] / base:.2f}× | "
                f"{row['chosen tok/s'] / base:.2f}× | {identical} | {demo} |"
            )
    setting = str(machine.get("target_setting", "as --target-setting")).split(" (")[0]
    lines += ["", f"Hugging Face in-process, an int8 target (the services': {setting}) and the int8 drafts "
              "(tok/s ÷ its own target-only):", ""]  # fmt: skip
    modes = sorted({mode for key, row in rows.items() if key.startswith("hf") for mode in row} - {"target_only"})
    lines += ["| T | target-only | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for temperature in TEMPERATURES:
        row = rows[f"hf T={temperature}"]
        lines.append(
            f"| {temperature} | {row['target_only']:.1f} tok/s | "
            + " | ".join(f"{row.get(mode, float('nan')):.2f}×" for mode in modes)
            + " |"
        )
    for stack, temperature, error in summary["errors"]:
        lines.append(f"\n{stack} at T = {temperature} failed: {error}")
    lines.append(
        "\nc: a draft step ÷ a one-token target pass, as the services timed them at start-up. Acceptance: accepted ÷ "
        "proposed draft tokens. Greedy identical: outputs equal to the same stack's K = 0 (K = 4, chosen)."
    )
    return "\n".join(lines) + "\n"
