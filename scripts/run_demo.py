"""`make run`: start draft, target and coordinator on loopback with the real Qwen2.5-Coder pair,
generate for a few prompts with the target alone and with speculation, and print the text and
the speculation figures side by side."""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.demo_prompts import QUESTIONS, SYSTEM  # noqa: E402
from specdec.engine.calls import numerics  # noqa: E402
from specdec.engine.costs import cpu_flags, cpu_model  # noqa: E402
from specdec.tools.launch import local_stack, stopped_on_sigterm  # noqa: E402
from specdec.tools.real_models import DRAFT, TARGET  # noqa: E402
from specdec.v1 import (  # noqa: E402
    common_pb2,
    coordinator_pb2_grpc,  # noqa: E402
    draft_pb2_grpc,
)
from specdec.v1 import coordinator_pb2 as pb  # noqa: E402
from target_service.pick import FLAGS, OUTPUT, pick_in_subprocess  # noqa: E402

TARGET_SETTINGS = FLAGS  # --target-setting: the target service's --dtype and --quantize
HEAD_NAME = "qwen2.5-coder-1.5b-eagle-head"  # the head `make head` trains, under --models-dir


def chat(question: str) -> list[pb.ChatMessage]:
    """The question as chat messages: the coordinator renders them with the model's own chat
    template (Qwen's ChatML), the assistant's turn opened."""
    return [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content=question)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models-dir", type=Path, default=ROOT / ".cache/models")
    parser.add_argument(
        "--draft-dtype",
        default="float32",
        help="float32 lets the draft service quantise the draft to int8 (its CPU default); bfloat16 keeps it as is",
    )
    parser.add_argument(
        "--drafter",
        choices=["model", "ngram", "hybrid", "eagle"],
        default="hybrid",
        help="draft service drafter (hybrid: prompt lookup where the text repeats itself, the model elsewhere; "
        "eagle: the head in --draft-head, fed the target's features)",
    )
    parser.add_argument(
        "--draft-head",
        type=Path,
        default=None,
        help=f"with --drafter eagle: the head's folder (default: MODELS_DIR/{HEAD_NAME}, which `make head` trains)",
    )
    parser.add_argument(
        "--target-setting",
        choices=["auto", *TARGET_SETTINGS],
        default="auto",
        help="auto: time float32, bfloat16 and int8 target passes on this machine and use the fastest "
        "(only float32 gives the checkpoint's own output; the demo says what the pick means)",
    )
    parser.add_argument(
        "--k", type=int, default=None, help="speculative tokens per round (default: the coordinator chooses each round)"
    )
    parser.add_argument(
        "--min-confidence", type=float, default=None, help="draft confidence stop (default: the draft service's)"
    )
    parser.add_argument(
        "--pipeline", choices=["on", "off"], default="off", help="coordinator: pre-draft during verification"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per model service")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampled runs")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.draft_head is not None and args.drafter != "eagle":
        parser.error(f"--draft-head is a head for --drafter eagle; the drafter here is {args.drafter}")

    draft_dir, target_dir = args.models_dir / DRAFT.name, args.models_dir / TARGET.name
    draft_args, draft_name = ["--drafter", args.drafter], DRAFT.name
    if args.drafter == "eagle":
        # The head drafts from the target's own embedding and features: its service loads the target's folder.
        head = args.draft_head or args.models_dir / HEAD_NAME
        if not (head / "config.json").is_file():
            print(
                f"no EAGLE head in {head}: `make head` trains one for this pair (hours on 2 cores), "
                "or pass --draft-head DIR",
                file=sys.stderr,
            )
            return 2
        draft_dir, draft_args, draft_name = target_dir, [*draft_args, "--draft-head", str(head)], head.name
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="specdec-logs-"))
    print(cpu_line())
    setting = args.target_setting
    if setting == "auto":
        with stopped_on_sigterm():  # SIGTERM stops the pick's process too (it loads the target three times)
            setting = pick_target(target_dir, args.threads)
    args.target_dtype, target_quantize = TARGET_SETTINGS[setting]
    print(
        f"starting draft ({draft_name}, {args.draft_dtype}, drafter {args.drafter}) and target ({TARGET.name}, "
        f"{setting}: --dtype {args.target_dtype} --quantize {target_quantize}); logs in {log_dir}\n"
        f"target {setting}: {OUTPUT[setting]}"
    )
    with local_stack(
        draft_dir,
        target_dir,
        log_dir,
        draft_dtype=args.draft_dtype,
        target_dtype=args.target_dtype,
        threads=args.threads,
        draft_args=draft_args + ([] if args.min_confidence is None else ["--min-confidence", str(args.min_confidence)]),
        target_args=["--quantize", target_quantize],
        # Its services are local and never restart: one that dies is reported at once (`died`),
        # where the default would have the coordinator wait 120 s for it to come back.
        coordinator_args=["--pipeline", args.pipeline, "--connect-timeout", "5"],
        cwd=ROOT,
    ) as services:
        with grpc.insecure_channel(services["draft"].address) as channel:
            draft_info = draft_pb2_grpc.DraftStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
        print(
            f"coordinator on {services['coordinator'].address} (draft {services['draft'].address}: "
            f"{draft_info.model_id.rsplit('/', 1)[-1]}, "
            f"{numerics(draft_info.dtype, draft_info.quantization)}; target {services['target'].address})\n"
        )
        try:
            return run_prompts(services["coordinator"].address, args)
        except grpc.RpcError as exc:
            died = [service for service in services.values() if service.process.poll() is not None]
            if not died:
                raise
            for service in died:
                print(
                    f"{service.name} exited with {service.process.returncode}; its log: {service.log}", file=sys.stderr
                )
                print(textwrap.indent(service.log.read_text()[-2000:], "  "), file=sys.stderr)
            print(f"the call failed: {exc.details()}", file=sys.stderr)
            return 1


def cpu_line() -> str:
    """The CPU and its vector extensions: every figure printed below depends on them."""
    import torch

    return f"CPU: {cpu_model()}; {cpu_flags()}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def pick_target(target_dir: Path, threads: int) -> str:
    print("measuring the target's settings on this machine (python -m target_service.pick, about a minute) ...")
    try:
        choice = pick_in_subprocess(target_dir, threads, cwd=ROOT)
    except RuntimeError as exc:
        print(f"{exc}\nusing int8, unmeasured (--target-setting picks one)")
        return "int8"
    print(choice["table"])
    print(f"picked target setting {choice['setting']}: {choice['reason']}\n")
    return choice["setting"]


def run_prompts(address: str, args: argparse.Namespace) -> int:
    rows = []
    greedy = args.temperature == 0.0
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        # One short request first, so neither mode pays the first-call warm-up.
        stub.Generate(pb.GenerateRequest(messages=chat("hi"), max_new_tokens=4, num_speculative_tokens=args.k))
        speculation = {} if args.k is None else {"num_speculative_tokens": args.k}
        for question in QUESTIONS:
            request = dict(
                messages=chat(question),
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
            )
            target_only = stub.Generate(pb.GenerateRequest(**request, num_speculative_tokens=0), timeout=600)
            speculative = stub.Generate(pb.GenerateRequest(**request, **speculation), timeout=600)
            same = list(target_only.token_ids) == list(speculative.token_ids)
            s = speculative.stats
            print("=" * 100)
            print(f"USER: {question.splitlines()[0][:90]}")
            print("-" * 100)
            print(textwrap.indent(speculative.text.strip(), "  "))
            print("-" * 100)
            print(
                f"  target only : {target_only.stats.generated_tokens} tokens, "
                f"{target_only.stats.tokens_per_second:5.2f} tok/s\n"
                f"  speculative : {s.generated_tokens} tokens, {s.tokens_per_second:5.2f} tok/s, "
                f"K={args.k if args.k is not None else 'chosen'} ({s.proposed_tokens / max(1, s.rounds):.1f} "
                "drafts/round), "
                f"{s.rounds} rounds"
                + (f" ({s.copied_rounds} of them copies, {s.copied_tokens} tokens)" if s.copied_rounds else "")
                + f", acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_length:.2f} tokens/round, "
                f"TTFT {s.time_to_first_token_ms:.0f} ms, draft {s.draft_ms:.0f} ms, target {s.target_ms:.0f} ms\n"
                + (
                    f"  the draft failed {s.draft_failures} times: {s.fallback_rounds} rounds ran target-only "
                    "(the draft service's log says why)\n"
                    if s.fallback_rounds
                    else ""
                )
                + f"  speedup {s.tokens_per_second / target_only.stats.tokens_per_second:.2f}x"
                + (f"; output identical to target-only: {'yes' if same else 'no'}" if greedy else "")
            )
            rows.append((target_only.stats, s, same))
    total_tokens = sum(s.generated_tokens for _, s, _ in rows)
    base_tps = sum(t.generated_tokens for t, _, _ in rows) / sum(t.total_ms / 1e3 for t, _, _ in rows)
    spec_tps = total_tokens / sum(s.total_ms / 1e3 for _, s, _ in rows)
    acceptance = sum(s.accepted_tokens for _, s, _ in rows) / max(1, sum(s.proposed_tokens for _, s, _ in rows))
    committed = sum(s.accepted_tokens + s.recovered_tokens + s.bonus_tokens for _, s, _ in rows)
    per_round = committed / max(1, sum(s.rounds for _, s, _ in rows))  # pooled, as the acceptance
    print("=" * 100)
    print(
        f"overall: target only {base_tps:.2f} tok/s, speculative {spec_tps:.2f} tok/s "
        f"({spec_tps / base_tps:.2f}x), acceptance {acceptance:.2f}, "
        f"mean tokens/round {per_round:.2f}"
        + (
            f", identical outputs {sum(same for *_, same in rows)}/{len(rows)}"
            if greedy
            else f", temperature {args.temperature}"
        )
    )
    if fallback := sum(s.fallback_rounds for _, s, _ in rows):
        print(f"warning: {fallback} rounds ran target-only because the draft failed: these figures undersell it")
    if greedy and any(not same for *_, same in rows) and args.target_dtype != "float32":
        print(
            "note: in bfloat16 a K+1-token verify pass and a 1-token pass round differently, so greedy output can\n"
            "      drift from target-only decoding; with --target-setting float32 or int8 it is token-identical."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
