"""What a session with a GPU checks, in one command that fits a short lease:

    python -m bench.gpu_check --device cuda --dtype bfloat16 --out $OUT

1. **Pass costs.** Each model's forward pass, timed on the device as the services run it: over
   1 to 512 new tokens after a short context, and one token after longer contexts; each the
   lower quartile of `--pass-repeats` passes, as the services calibrate. Written as
   pass-cost profiles (`profile-target.json`, `profile-draft.json`, the `bench/profiles/` format
   that bench.emulated loads), so the emulated suites can be anchored to the card.
2. **Greedy identity.** The three services on the device; every prompt greedy, target-only
   (K = 0: the target's own output), with the K chooser, with K = 4, and pipelined with hedges.
   Each output is compared with target-only's token by token, and with in-process transformers
   `generate()` for information.
3. **Speed.** tok/s of each mode from the coordinator's own request times, the modes
   interleaved over the repeats; then in-process transformers `generate()`, eager and with its
   static cache (which on CUDA it compiles with torch.compile).
4. **Captured against eager passes** (issue 67's goals), each model loaded once per
   `--graph-settings`: `--cuda-graphs off`, `on` (captured on CUDA) and `compiled` (compiled by
   torch.compile, then captured): a one-token pass, a verify of 8 tokens (the target) and, for
   the target, a batched pass of 32 sessions × 5 tokens, after 128 cached tokens each, and the
   whole batched verify of such rounds, greedy and at T = 1 (the pass and the draws from it);
   the same lower quartile; and each setting's logits against eager's. Steps 1-3 run with the
   services' default (`auto`: captured on CUDA), so their profile is the captured passes'.

Models: `--target` and `--draft` (default: the real pair `make run` prepares in .cache/models).
A folder with a config and a tokenizer but no weights (a device machine reaches no model hub,
and a lease carries 64 MiB) gets random weights of that shape, seeded: pass costs and greedy
identity are the model's whatever its weights, but acceptance, and so the speed of speculation,
are not, and the report says so. report.md and results.json go to --out. `--profiles-only`
stops after step 1 (about two minutes on an H200, the models' making included).

It runs on any device: the tests run it with `--device cpu` on the tiny pair. How to carry it
to a device machine: bench/profiles/README.md, "Measuring a card".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from specdec.engine.costs import settled
from specdec.engine.pace import load_profile
from specdec.engine.static_pass import Bucket, length_bucket
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.tools.launch import ServiceProcess, local_stack, spawn_coordinator
from specdec.tools.real_models import DRAFT, TARGET
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / ".cache/models"
PROMPTS = [
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "SELECT customer_id, SUM(amount) FROM orders",
    "Speculative decoding lets a small model draft tokens that a large model",
]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Modes: (coordinator, num_speculative_tokens; None: the K chooser).
MODES = {
    "target-only (K=0)": ("default", 0),
    "K chooser": ("default", None),
    "K=4": ("default", 4),
    "pipelined + 4 hedges, K chooser": ("pipelined", None),
}
# GenerationStats fields summed per mode and reported per token: where a mode's time went.
SPENT = (
    "draft_ms", "draft_compute_ms", "target_ms", "target_compute_ms", "rounds", "proposed_tokens", "copied_rounds",
    "catch_up_rounds", "predrafts", "hedges", "fallback_rounds",
)  # fmt: skip
GRAPH_CONTEXT = 128  # cached tokens under the captured-against-eager passes
ONE_TOKEN = Bucket(1, 1, length_bucket(GRAPH_CONTEXT + 1))  # their one-token pass's static bucket
STEPS = ("captured_against_eager", "profiles", "services", "transformers_generate", "transformers_generate_static")
COORDINATORS = {"default": [], "pipelined": ["--pipeline", "on", "--hedges", "4", "--bonus-guesses", "3"]}


@dataclass
class Checked:
    """One model: its folder (weights made here where it had none)."""

    role: str
    folder: Path
    random_weights: bool


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def with_weights(role: str, folder: Path, dtype: str, work: Path, seed: int) -> Checked:
    """The model folder as given, or a copy with random weights of its config's shape."""
    if any((folder / name).exists() for name in WEIGHT_FILES):
        return Checked(role, folder, random_weights=False)
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / f"{role}-{dtype}" / folder.name  # the model's name, which the profiles carry
    if out.exists():  # made by an earlier run into --work (renamed there once whole)
        return Checked(role, out, random_weights=True)
    making = out.with_name(f"{folder.name}.partial")  # a run killed while saving leaves only this
    shutil.rmtree(making, ignore_errors=True)
    shutil.copytree(folder, making)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(making)
    making.rename(out)
    return Checked(role, out, random_weights=True)


def time_pass(runner, session, context: int, new_ids: list[int], keep_all: bool, device: str, repeats: int) -> float:
    """ms of a pass over `new_ids` on top of the session's first `context` tokens: the lower
    quartile of `repeats` passes, as the services calibrate (specdec.engine.costs.settled). An
    eager pass on a GPU is bound by the host launching its kernels, so a disturbed host reads
    as a slow pass; a median of three let one such read set a size's cost."""

    def run(feed) -> None:
        with torch.inference_mode():
            runner.forward(session, feed, len(new_ids) if keep_all else 1)

    return settled_ms(lambda: session.extend(context, new_ids), run, device, repeats)


def settled_ms(prepare: Callable[[], Any], run: Callable[[Any], None], device: str, repeats: int) -> float:
    """ms of `run(prepare())`, timed alone with the device synchronised around it: the lower
    quartile (specdec.engine.costs.settled) of `repeats` runs after one that warms up."""
    times = []
    for repeat in range(repeats + 1):
        prepared = prepare()
        synchronize(device)
        started = time.perf_counter()
        run(prepared)
        synchronize(device)
        if repeat:
            times.append((time.perf_counter() - started) * 1e3)
    return settled(times)


def measure_profile(runner, name: str, device: str, sizes: list[int], contexts: list[int], repeats: int) -> dict:
    """The model's pass-cost profile (specdec.engine.pace): ms by new tokens after contexts[0]
    cached tokens, less that context's share, and the share per 1k cached tokens, fitted to
    one-token passes after each of `contexts`."""
    keep_all = name == "target"  # the target scores every new token; the draft keeps the last
    vocab = runner.loaded.vocab_size
    limit = runner.loaded.max_context - max(sizes) - 1
    contexts = sorted({min(c, limit) for c in contexts})
    ids = torch.randint(0, vocab, (max(contexts) + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    at_context = []

    def timed(session, context: int, n: int) -> float:
        return time_pass(runner, session, context, ids[context : context + n], keep_all, device, repeats)

    for index, context in enumerate(contexts):
        session = runner.sessions.open(f"profile-{index}", 0)
        with torch.inference_mode():
            runner.forward(session, session.extend(0, ids[:context]), logits_to_keep=1)
        at_context.append((context, timed(session, context, 1)))
        if index == 0:
            by_size = {n: timed(session, context, n) for n in sizes}
        runner.end_session(f"profile-{index}", keep=False)
    slope = 0.0
    if len(at_context) > 1:  # least squares over (context, ms)
        mean_c = statistics.mean(c for c, _ in at_context)
        mean_ms = statistics.mean(ms for _, ms in at_context)
        spread = sum((c - mean_c) ** 2 for c, _ in at_context)
        slope = max(0.0, sum((c - mean_c) * (ms - mean_ms) for c, ms in at_context) / spread) if spread else 0.0
    base = contexts[0] * slope
    points, floor = [], 0.0
    for n in sizes:  # never less than a smaller pass: a disturbed run reads as noise, not a dip
        floor = max(floor, by_size[n] - base)
        points.append([n, round(floor, 3)])
    return {
        "pass_ms": points,
        "context_ms_per_1k": round(slope * 1000.0, 4),
        "measured_context_ms": [[c, round(ms, 3)] for c, ms in at_context],
    }


def profiles(checked: list[Checked], args, device_name: str) -> dict:
    """Each model's pass-cost profile, written to --out as profile-<role>.json."""
    measured = {}
    for model in checked:
        runner = load_runner(model, args, "auto")
        figures = measure_profile(runner, model.role, args.device, args.sizes, args.contexts, args.pass_repeats)
        weights = "random weights of its shape" if model.random_weights else "its own weights"
        measured[model.role] = profile = {
            "name": f"{device_name} {model.folder.name} {args.dtype}",
            "source": (
                f"MEASURED by python -m bench.gpu_check on {device_name}, torch {torch.__version__}, "
                f"{args.dtype}, {model.folder.name} ({weights}), {time.strftime('%Y-%m-%d')}: lower "
                f"quartile of {args.pass_repeats} passes after a warm-up; pass_ms after {min(args.contexts)} cached "
                "tokens, less the context's share; context_ms_per_1k fitted to one-token passes after "
                f"{', '.join(str(c) for c, _ in figures['measured_context_ms'])} cached tokens."
            ),
            **figures,
        }
        path = args.out / f"profile-{model.role}.json"
        path.write_text(json.dumps(profile, indent=1) + "\n")
        load_profile(str(path))  # the services accept it, or this fails here
        del runner
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return measured


def load_runner(model: Checked, args, cuda_graphs: str, max_batch_size: int = 8):
    """The service's runner for `model`, loaded as the service loads it, without calibration."""
    from draft_service.config import parse_config as draft_config
    from draft_service.server import load_runner as load_draft
    from target_service.config import parse_config as target_config
    from target_service.loading import load_runner as load_target

    flags = ["--model", str(model.folder), "--device", args.device, "--dtype", args.dtype, "--calibrate", "off"]
    flags += ["--max-speculative-tokens", "8", "--cuda-graphs", cuda_graphs, "--max-batch-size", str(max_batch_size)]
    return load_target(target_config(flags)) if model.role == "target" else load_draft(draft_config(flags))


def captured_against_eager(
    checked: list[Checked], args, results: dict | None = None, measured: Callable[[], None] = lambda: None
) -> dict:
    """Per model and --cuda-graphs setting: s to load it (capturing and compiling included),
    ms of a one-token pass, an 8-token verify (the target) and a batched pass and verify of
    `args.batch_sessions` × 5 tokens (the target, `time_batch`), each after 128 cached tokens; and the
    buckets the static passes ran. Filled into `results` as each setting is measured, and
    `measured` called then: a lease that ends mid-step keeps what it measured."""
    results = {} if results is None else results
    for model in checked:
        results[model.role] = {}
        scored: dict[str, torch.Tensor] = {}  # the 8-token pass's logits under each setting
        for setting in args.graph_settings:
            started = time.perf_counter()
            runner = load_runner(model, args, setting, max_batch_size=args.batch_sessions)
            loaded_s = time.perf_counter() - started
            vocab, context = runner.loaded.vocab_size, GRAPH_CONTEXT
            ids = torch.randint(0, vocab, (context + 8,), generator=torch.Generator().manual_seed(2)).tolist()
            session = runner.sessions.open("graphs", 0)
            with torch.inference_mode():
                runner.forward(session, session.extend(0, ids[:context]), logits_to_keep=1)
            keep_all = model.role == "target"
            with torch.inference_mode():
                scored[setting] = runner.forward(session, session.extend(context, ids[context:]), 8).float().cpu()
            figures: dict[str, float | str] = {
                "1 token": time_pass(
                    runner, session, context, ids[context : context + 1], keep_all, args.device, args.pass_repeats
                )
            }
            if model.role == "target":
                figures["8 tokens"] = time_pass(
                    runner, session, context, ids[context:], True, args.device, args.pass_repeats
                )
                figures.update(time_batch(runner, ids, context, args))
            if setting != "off" and runner.static is not None:
                if runner.static.capture:
                    figures["1 token, graph replay alone"] = time_replay(runner.static, args)
                results[model.role][f"anatomy {setting}"] = anatomy(runner.static, args)
            runner.end_session("graphs", keep=False)
            figures["buckets"] = runner.static.describe() if runner.static is not None else "eager"
            figures["load s"] = round(loaded_s, 1)
            results[model.role][setting] = figures
            if setting != "off" and "off" in scored:
                results[model.role][f"logits {setting}"] = closeness(scored[setting], scored["off"])
            measured()
            del runner, session
            # Dynamo keeps compiled passes by code, not by runner: the next model's would count
            # against the same recompile limit (a service compiles its one model's alone).
            torch._dynamo.reset()
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return results


def closeness(got: torch.Tensor, eager: torch.Tensor) -> dict:
    """How close a captured (or compiled) pass's logits are to an eager pass's over the same
    tokens (the same weights: every load reads one folder): the largest difference, and
    argmax agreement."""
    return {
        "max_abs_diff": float((got - eager).abs().max()),
        "max_abs_logit": float(eager.abs().max()),
        "same_argmax": int((got.argmax(-1) == eager.argmax(-1)).sum()),
        "positions": int(eager.shape[0]),
    }


def time_replay(static, args) -> float:
    """ms of replaying the one-session one-token bucket's graph alone (on CUDA; 0 where it
    has none): what the card takes for the pass, against what runner.forward takes around it."""
    _, replay = static.pass_over_pads(ONE_TOKEN)
    if replay is None:
        return 0.0
    return settled_ms(lambda: None, lambda _: replay(), args.device, args.pass_repeats)


def anatomy(static, args, top: int = 12) -> dict:
    """What the one-session one-token static pass runs (its bucket's pass, uncaptured, over
    pads only: a graph replays these same kernels): under torch.profiler, the ops it calls and,
    on CUDA, its kernels, their summed device time and the `top` dearest. Against the replay's
    time it says whether a captured pass is its kernels' work or the gaps between them.
    A failure is reported, not raised."""
    try:
        run, _ = static.pass_over_pads(ONE_TOKEN)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.inference_mode():
            run()  # warm
            synchronize(args.device)
            with torch.profiler.profile(activities=activities) as profile:
                run()
                synchronize(args.device)
        events = profile.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")]
        by_name: dict[str, list[float]] = {}
        for kernel in kernels:
            by_name.setdefault(kernel.name[:80], []).append(kernel.time_range.elapsed_us() / 1e3)
        dearest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
        return {
            "aten_ops": len(ops),
            "kernels": len(kernels),
            "kernel_ms": round(sum(sum(times) for times in by_name.values()), 3),
            "top": [[name, len(times), round(sum(times), 3)] for name, times in dearest],
        }
    except Exception as exc:  # noqa: BLE001 - reported in the results instead
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def time_batch(runner, ids: list[int], context: int, args) -> dict[str, float | str]:
    """ms of one batched pass of `args.batch_sessions` sessions × 5 tokens after `context`
    cached tokens each (their prompts prefilled first), and of the whole batched verify of
    such rounds (a token and 4 drafts each), greedy and at T = 1: the pass and what the target
    draws from it (specdec.sampling.together); at T = 1 also each call's draft rows, a top-256
    draft's [4, V] as the service decodes them (their entries, built on the device). Each the
    lower quartile of the repeats."""
    from target_service.runner import VerifyCall

    sessions = [runner.sessions.open(f"batch-{i}", 0) for i in range(args.batch_sessions)]
    with torch.inference_mode():
        for session in sessions:
            runner.forward(session, session.extend(0, ids[:context]), logits_to_keep=1)
    rows = f"{args.batch_sessions} x 5"
    figures: dict[str, float | str] = {
        f"{rows} tokens": settled_ms(
            lambda: [session.extend(context, ids[context : context + 5]) for session in sessions],
            lambda feeds: runner.forward_batch(sessions, feeds, [5] * len(sessions)),
            args.device,
            args.pass_repeats,
        )
    }

    def verified(calls: list) -> None:
        """verify_batch hands a call's failure back as its result: time no failed batch."""
        failed = next((result for result in runner.verify_batch(calls) if isinstance(result, Exception)), None)
        if failed is not None:
            raise failed

    vocab, drafts = runner.loaded.vocab_size, ids[context + 1 : context + 5]
    dense = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)), dim=-1)  # [4, V]
    top = dense.topk(256, dim=-1)
    dense = torch.zeros_like(dense).scatter_(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    rows_drawn = wire.decode_distributions(wire.encode_distributions(dense, 4, False), drafts, vocab)
    for name, params in (("greedy", SamplingParams()), ("T=1", SamplingParams(temperature=1.0))):
        calls = [
            VerifyCall(session.session_id, context, ids[context : context + 1], drafts, rows_drawn, params, seed)
            for seed, session in enumerate(sessions)
        ]  # each rolls its session back to `context` first
        try:
            with torch.inference_mode():
                figures[f"{rows} verify, {name}"] = settled_ms(calls.copy, verified, args.device, args.pass_repeats)
        except Exception as exc:  # noqa: BLE001 - reported in the results, and the lease measures on
            figures[f"{rows} verify, {name}"] = f"error: {type(exc).__name__}: {exc}"[:500]
    for session in sessions:
        runner.end_session(session.session_id, keep=False)
    return figures


def generate(stub, prompt_ids: list[int], k: int | None, max_new_tokens: int) -> pb.GenerateResponse:
    request = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0)
    if k is not None:
        request.num_speculative_tokens = k
    return stub.Generate(request, timeout=600)


def services(checked: dict[str, Checked], args, prompts: list[list[int]]) -> dict:
    """Every mode on every prompt, interleaved over the repeats: outputs and speeds."""
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
    tokens = dict.fromkeys(MODES, 0)
    ms = dict.fromkeys(MODES, 0.0)
    accepted = dict.fromkeys(MODES, 0)
    spent: dict[str, dict[str, float]] = {mode: dict.fromkeys(SPENT, 0.0) for mode in MODES}
    logs = args.logs or args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        running: dict[str, ServiceProcess] = stack.enter_context(
            local_stack(
                checked["draft"].folder,
                checked["target"].folder,
                logs,
                draft_dtype=args.dtype,
                target_dtype=args.dtype,
                device=args.device,
                threads=args.threads,
                cwd=ROOT,
            )
        )
        coordinators = {"default": running["coordinator"]}
        coordinators["pipelined"] = spawn_coordinator(
            running["draft"], running["target"], checked["target"].folder, logs / "coordinator-pipelined.log",
            COORDINATORS["pipelined"], ROOT,
        )  # fmt: skip
        stack.callback(coordinators["pipelined"].stop)
        stubs = {
            name: coordinator_pb2_grpc.CoordinatorStub(stack.enter_context(grpc.insecure_channel(c.address)))
            for name, c in coordinators.items()
        }
        for stub in stubs.values():  # warm-up
            generate(stub, prompts[0], None, 8)
        modes = list(MODES)
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                coordinator, k = MODES[mode]
                for index, prompt in enumerate(prompts):
                    response = generate(stubs[coordinator], prompt, k, args.max_new_tokens)
                    if repeat == 0:
                        outputs[mode].append(list(response.token_ids))
                    elif list(response.token_ids) != outputs[mode][index]:
                        outputs[mode][index] = []  # greedy must repeat itself: flagged below
                    tokens[mode] += response.stats.generated_tokens
                    ms[mode] += response.stats.total_ms
                    accepted[mode] += response.stats.accepted_tokens
                    for name in SPENT:
                        spent[mode][name] += getattr(response.stats, name)
    reference = outputs["target-only (K=0)"]
    results = {}
    for mode in MODES:
        divergence = [first_difference(reference[i], outputs[mode][i]) for i in range(len(prompts))]
        results[mode] = {
            "identical": sum(d is None for d in divergence),
            "first_difference": divergence,
            "tok_s": tokens[mode] / ms[mode] * 1e3 if ms[mode] else 0.0,
            "acceptance": accepted[mode] / proposed if (proposed := spent[mode]["proposed_tokens"]) else None,
            "per_token": {name: round(value / max(tokens[mode], 1), 3) for name, value in spent[mode].items()},
        }
    return {"modes": results, "target_only": reference}


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first position where `got` leaves `expected`; None where they agree."""
    if expected == got and got:
        return None
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def in_process(checked: Checked, args, prompts: list[list[int]], reference: list[list[int]], static: bool) -> dict:
    """transformers generate(), greedy, in this process on the device: agreement with the
    services' target-only outputs, and its speed. `static`: with its static cache, which on
    CUDA makes generate() compile the forward with torch.compile (the fastest in-process form a
    GPU user would try; its compilation, in the first call, is timed apart); on CPU the static
    cache runs uncompiled. A failure is reported, not raised: the lease's other figures stand."""
    from specdec.engine.modeling import load_causal_lm

    model = load_causal_lm(str(checked.folder), args.dtype, args.device).model
    options: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": 0, "min_new_tokens": 0}
    if static:  # one cache size for every prompt: one compilation
        options.update(cache_implementation="static", max_cache_len=max(map(len, prompts)) + args.max_new_tokens + 8)

    def run(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            return model.generate(ids, **options)[0, len(prompt) :].tolist()  # type: ignore[operator]

    agree, tokens, seconds, first_s = 0, 0, 0.0, 0.0
    try:
        if static:
            started = time.perf_counter()
            run(prompts[0])
            synchronize(args.device)
            first_s = time.perf_counter() - started
        for prompt, expected in zip(prompts, reference):
            synchronize(args.device)
            started = time.perf_counter()
            out = run(prompt)
            synchronize(args.device)
            seconds += time.perf_counter() - started
            tokens += len(out)
            agree += first_difference(expected, out[: len(expected)]) is None
    except Exception as exc:  # noqa: BLE001 - reported in the results instead
        return {"identical": agree, "tok_s": 0.0, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"identical": agree, "tok_s": tokens / seconds if seconds else 0.0, "first_call_s": round(first_s, 1)}


def graph_settings_report(compared: dict, settings: list[str]) -> list[str]:
    """The captured-against-eager step's lines: per model and pass, ms under each --cuda-graphs
    setting (the first, off, eager) and each one's ratio to eager; how close each setting's
    logits are to eager's; the buckets run and the one-token pass's profile."""
    others = settings[1:]
    lines = ["", f"## --cuda-graphs {', '.join(others)} against eager (off) passes, ms after 128 cached tokens", ""]
    lines += ["| model | pass | eager | " + " | ".join(f"{s} | {s} / eager" for s in others) + " |"]
    lines += ["|---|---|---|" + "---|---|" * len(others)]
    for role, measured in compared.items():
        for setting in others:
            close = measured.get(f"logits {setting}")
            if close is None:  # not measured (a lease that ended mid-step)
                continue
            lines.append(
                f"| {role} | logits of an 8-token pass, {setting} | largest abs. logit {close['max_abs_logit']:.2f} | "
                f"largest difference {close['max_abs_diff']:.3g}, argmax agrees at "
                f"{close['same_argmax']}/{close['positions']} |" + " |" * (2 * len(others) - 1)
            )
        names = [name for setting in settings for name in measured.get(setting, {}) if name != "buckets"]
        for name in dict.fromkeys(names):
            eager = measured.get("off", {}).get(name)
            cells = [f"{eager:.2f}" if eager is not None else ""]
            for setting in others:
                ms = measured.get(setting, {}).get(name)
                cells += [f"{ms:.2f}" if ms is not None else "", f"{ms / eager:.2f}" if ms and eager else ""]
            lines.append(f"| {role} | {name} | " + " | ".join(cells) + " |")
    for role, measured in compared.items():
        for setting in [s for s in others if s in measured]:
            lines.append(f"\n{role}'s passes under {setting}: {measured[setting]['buckets']}")
            parts = measured.get(f"anatomy {setting}", {})
            if "error" in parts:
                lines.append(f"\n{role}'s one-token pass under {setting}, profiled: {parts['error']}")
            elif parts:
                lines.append(
                    f"\n{role}'s one-token pass under {setting}, profiled uncaptured: {parts['aten_ops']} aten ops, "
                    f"{parts['kernels']} kernels, {parts['kernel_ms']:.2f} ms of them on the device; the dearest "
                    "(kernel, launches, ms): "
                    + "; ".join(f"{name} {count} {ms:.3f}" for name, count, ms in parts["top"])
                )
    return lines


def report(results: dict, args) -> str:
    lines = [
        f"# gpu_check on {results['device_name']} ({results['date']})",
        "",
        f"torch {results['torch']}, {args.dtype}, target {results['models']['target']}, draft "
        f"{results['models']['draft']}; {len(results['prompts'])} prompts x {args.max_new_tokens} tokens, greedy, "
        f"{args.repeats} repeats interleaved.",
    ]
    if results["random_weights"]:
        lines.append(
            "Random weights of the models' shapes: pass costs and greedy identity hold, but acceptance and so "
            "the speed of speculation are not the real pair's."
        )
    lines += [
        "",
        "## Pass costs (ms)",
        "",
        "| model | " + " | ".join(f"{n} tok" for n in args.sizes) + " | ms per 1k context |",
    ]
    lines.append("|---|" + "---|" * (len(args.sizes) + 1))
    for role, profile in results.get("profiles", {}).items():
        cells = " | ".join(f"{ms:.2f}" for _, ms in profile["pass_ms"])
        lines.append(f"| {role} | {cells} | {profile['context_ms_per_1k']:.3f} |")
    lines += graph_settings_report(results.get("captured_against_eager", {}), args.graph_settings)
    for name, error in results.get("errors", {}).items():
        lines += ["", f"## Failed: {name}", "", "```", error.rstrip(), "```"]
    if results["services"] is None:
        why = "--profiles-only" if args.profiles_only else "they failed"
        return "\n".join(lines) + f"\n\nThe services' modes were not measured: {why}.\n"
    lines += ["", "## Greedy identity and speed", ""]
    lines.append("| mode | identical to target-only | first difference | tok/s | acceptance |")
    lines.append("|---|---|---|---|---|")
    count = len(results["prompts"])
    for mode, figures in results["services"]["modes"].items():
        acceptance = "" if figures["acceptance"] is None else f"{figures['acceptance']:.2f}"
        lines.append(
            f"| {mode} | {figures['identical']}/{count} | {figures['first_difference']} | "
            f"{figures['tok_s']:.1f} | {acceptance} |"
        )
    for name, label in (
        ("transformers_generate", "transformers generate() in process"),
        ("transformers_generate_static", "the same, static cache (+ torch.compile on CUDA)"),
    ):
        hf = results[name]
        if hf is None:
            continue
        note = (
            f" ({hf['error']})"
            if "error" in hf
            else f" (first call {hf['first_call_s']} s)"
            if hf.get("first_call_s")
            else ""
        )
        lines.append(f"| {label}{note} | {hf['identical']}/{count} | | {hf['tok_s']:.1f} | |")
    lines += ["", "Per generated token (sums over the mode's requests / tokens):", ""]
    lines += ["| mode | " + " | ".join(SPENT) + " |", "|---|" + "---|" * len(SPENT)]
    for mode, figures in results["services"]["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{figures['per_token'][name]:.3g}" for name in SPENT) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target", type=Path, default=MODELS / TARGET.name)
    parser.add_argument("--draft", type=Path, default=MODELS / DRAFT.name)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where random weights are made, and found by a later run (default: a temporary folder)",
    )
    parser.add_argument("--logs", type=Path, default=None, help="the services' logs (default: --out/logs)")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256,512", help="new tokens per timed pass")
    parser.add_argument("--contexts", default="128,1024,4096", help="cached tokens under the one-token passes")
    parser.add_argument("--pass-repeats", type=int, default=12, help="timed passes per size")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode")
    parser.add_argument("--profiles-only", action="store_true", help="measure the pass costs, skip the services")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per service (0: torch's default)")
    parser.add_argument("--steps", default=",".join(STEPS), help="the steps to run, of: " + ", ".join(STEPS))
    parser.add_argument("--batch-sessions", type=int, default=32, help="sessions in the timed batched verify")
    parser.add_argument(
        "--graph-settings",
        default="off,compiled,on",
        help="the --cuda-graphs settings the captured_against_eager step loads each model with, off first",
    )
    args = parser.parse_args(argv)
    args.sizes = sorted({int(n) for n in args.sizes.split(",")})
    args.contexts = sorted({int(n) for n in args.contexts.split(",")})
    args.steps = set(args.steps.split(","))
    args.graph_settings = args.graph_settings.split(",")
    if args.graph_settings[0] != "off" or set(args.graph_settings) - {"off", "on", "compiled"}:
        parser.error(f"--graph-settings: off, then any of on and compiled; got {','.join(args.graph_settings)}")
    if args.steps - set(STEPS):
        parser.error(f"--steps: no step {', '.join(sorted(args.steps - set(STEPS)))}; the steps are {', '.join(STEPS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """The steps, the one issue 67 waits on first; results.json and report.md are written after
    each, so a lease that runs out still brings back what was measured."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    from transformers import AutoTokenizer

    results: dict = {
        "device_name": device_name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "prompts": PROMPTS[: args.prompts],
        "services": None,
        "transformers_generate": None,
        "transformers_generate_static": None,
    }

    def save(step: str) -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "report.md").write_text(report(results, args))
        print(step, flush=True)

    def step(key: str, run, *inputs):
        """results[key] = run(*inputs), saved. A step that fails is reported (results' `errors`)
        and the next runs: a lease brings back every figure that could be measured, and why
        the rest failed."""
        if key not in args.steps:
            return None
        try:
            results[key] = run(*inputs)
        except Exception:  # noqa: BLE001 - reported in the results instead
            results.setdefault("errors", {})[key] = traceback.format_exc()[-4000:]
            print(results["errors"][key], flush=True)
        save(f"{key}: done")
        if args.device.startswith("cuda"):
            gc.collect()
            torch.cuda.empty_cache()
        return results.get(key)

    with contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        checked = {
            role: with_weights(role, folder, args.dtype, Path(work), seed)
            for role, folder, seed in (("target", args.target, 0), ("draft", args.draft, 1))
        }
        models = list(checked.values())
        results["models"] = {role: c.folder.name for role, c in checked.items()}
        results["random_weights"] = any(c.random_weights for c in models)
        print(f"models ready: {[(c.role, str(c.folder), c.random_weights) for c in models]}", flush=True)
        step(
            "captured_against_eager",
            captured_against_eager,
            models,
            args,
            results.setdefault("captured_against_eager", {}),
            lambda: save("captured_against_eager: a setting measured"),
        )
        step("profiles", profiles, models, args, device_name)
        if not args.profiles_only:
            tokenizer = AutoTokenizer.from_pretrained(checked["target"].folder)
            prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS[: args.prompts]]
            served = step("services", services, checked, args, prompts)
            reference = served["target_only"] if served else [[] for _ in prompts]
            for key, static in (("transformers_generate", False), ("transformers_generate_static", True)):
                step(key, in_process, checked["target"], args, prompts, reference, static)
    print(report(results, args), flush=True)
    return results


if __name__ == "__main__":
    main()
