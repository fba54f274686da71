"""How the benchmark runs a mode: our three services as processes, or transformers in process
(plain `generate` and assisted generation with the same pair)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from bench.modes import (
    COORDINATORS,
    PLACEMENTS,
    ROOT,
    BenchConfig,
    Mode,
    Sample,
    drafter_args,
    drafter_cpus,
    target_service_args,
)
from bench.rules_coordinator import coordinator_module
from specdec.engine.modeling import DTYPES
from specdec.engine.quantize import quantize_int8
from specdec.rpc.ports import free_port
from specdec.tools.launch import (
    COORDINATOR_START_S,
    ServiceProcess,
    model_service_args,
    spawn,
    spawn_coordinator,
    stop_all,
)
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc


class OursRunner:
    """One target service, and a draft service plus a coordinator per drafter variant, all
    separate processes on loopback. Rounds are sequential, so at most one computes at a time."""

    def __init__(self, config: BenchConfig, variants: list[tuple[str, str, str]], log_dir: Path) -> None:
        """`variants`: (drafter, coordinator, placement); one target per placement and one
        draft service per drafter."""
        drafters = list(dict.fromkeys(drafter for drafter, _, _ in variants))
        self._processes = ExitStack()
        self._started: list[ServiceProcess] = []  # stopped together, coordinators first (stop_all)
        self._processes.callback(stop_all, self._started)
        model_args, env = model_service_args(config.device, config.threads)
        try:
            targets = {}
            for placement in dict.fromkeys(placement for _, _, placement in variants):
                targets[placement] = self._start(
                    "target_service",
                    [*target_service_args(config), *model_args, *PLACEMENTS[placement]["target"].args],
                    log_dir / f"target-{placement}.log",
                    env,
                    PLACEMENTS[placement]["target"].cpus,
                )
                # One at a time: each service times its own passes at start-up (--calibrate), which a
                # neighbour loading its weights on the same cores would skew.
                targets[placement].wait_healthy(900)
            drafts = {}
            for name in drafters:
                drafts[name] = self._start(
                    "draft_service",
                    [
                        "--model",
                        str(config.draft_model),
                        "--dtype",
                        config.draft_dtype,
                        *model_args,
                        *drafter_args(name, config),
                    ],
                    log_dir / f"draft-{name}.log",
                    env,
                    drafter_cpus(name),
                )
                drafts[name].wait_healthy(900)
            self.channels: dict[tuple[str, str, str], grpc.Channel] = {}
            self.stubs: dict[tuple[str, str, str], coordinator_pb2_grpc.CoordinatorStub] = {}
            coordinators: list[ServiceProcess] = []
            for drafter, variant, placement in variants:
                coordinator = spawn_coordinator(
                    drafts[drafter],
                    targets[placement],
                    config.target_model,
                    log_dir / f"coordinator-{drafter}-{variant}-{placement}.log",
                    [
                        "--max-new-tokens-limit",
                        "4096",
                        *COORDINATORS[variant],
                        *PLACEMENTS[placement]["coordinator"].args,
                    ],
                    ROOT,
                    coordinator_module(COORDINATORS[variant]),
                    PLACEMENTS[placement]["coordinator"].cpus,
                    wait=False,
                )
                coordinators.append(coordinator)
                self._started.append(coordinator)
                key = (drafter, variant, placement)
                self.channels[key] = grpc.insecure_channel(coordinator.address)
                self.stubs[key] = coordinator_pb2_grpc.CoordinatorStub(self.channels[key])
            for coordinator in coordinators:
                coordinator.wait_healthy(COORDINATOR_START_S)
        except BaseException:
            self._processes.close()
            raise

    def _start(self, module: str, args: list[str], log: Path, env: dict[str, str], cpus: tuple[int, ...]):
        process = spawn(module, module, args, free_port(), log, env, ROOT, cpus=cpus)
        self._started.append(process)
        return process

    def run(self, mode: Mode, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> Sample:
        request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        if mode.tree:
            request.tree_widths.extend(mode.tree)
        elif not mode.adaptive:
            request.num_speculative_tokens = mode.k
        response = self.stubs[mode.drafter, mode.coordinator, mode.placement].Generate(request, timeout=3600)
        s = response.stats
        return Sample(
            mode.name,
            "",
            temperature,
            0,
            s.generated_tokens,
            s.total_ms,
            s.time_to_first_token_ms,
            s.rounds,
            s.proposed_tokens,
            s.accepted_tokens,
            list(s.accepted_per_position),
            s.draft_compute_ms,
            s.target_compute_ms,
            s.predrafts,
            s.predraft_hits,
            s.predraft_misses,
            s.predraft_cancelled,
            list(s.k_per_round),
            recovered=s.recovered_tokens,
            hedges=s.hedges,
            hedge_hits=s.hedge_hits,
            draft_ms=s.draft_ms,
            target_ms=s.target_ms,
            branch_wait_ms=s.branch_wait_ms,
            ready_rounds=s.ready_rounds,
            predraft_wasted_tokens=s.predraft_wasted_tokens,
            hedge_wasted_tokens=s.hedge_wasted_tokens,
            tree_rounds=s.tree_rounds,
            catch_up_rounds=s.catch_up_rounds,
            accepted_per_round=list(s.accepted_per_round),
            overhead_ms=sum(s.round_overhead_ms),
            degraded=s.degraded,
            fallback_rounds=s.fallback_rounds,
            draft_failures=s.draft_failures,
        )

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self._processes.close()


class _FirstTokenTimer(BaseStreamer):
    """transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    """The baseline a user has today: transformers in this process, same models and dtypes."""

    def __init__(self, config: BenchConfig, drafts: list[str]) -> None:
        self.device = config.device
        self.tokenizer = AutoTokenizer.from_pretrained(config.target_model)
        # Any: transformers types PreTrainedModel.to as a wrapper mypy cannot call.
        target: Any = AutoModelForCausalLM.from_pretrained(config.target_model, dtype=DTYPES[config.target_dtype])
        self.target = target.to(config.device).eval()
        if config.target_quantize == "int8":  # the same int8 layers as the target service
            quantize_int8(self.target)
        self.drafts = {}
        for name in drafts:
            dtype = DTYPES["float32" if name == "int8" else config.draft_dtype]
            draft: Any = AutoModelForCausalLM.from_pretrained(config.draft_model, dtype=dtype)
            draft = draft.to(config.device).eval()
            self.drafts[name] = quantize_int8(draft) if name == "int8" else draft
        self._default_assistant = (
            {
                name: getattr(next(iter(self.drafts.values())).generation_config, name, None)
                for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            }
            if self.drafts
            else {}
        )

    def run(self, mode: Mode, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> Sample:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        kwargs: dict = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
        if temperature > 0:
            # top_k=0: transformers would otherwise apply its default top-k of 50.
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        if mode.assisted == "lookup":
            kwargs["prompt_lookup_num_tokens"] = 10  # as in transformers' docs and shared/MODELS.md
        elif mode.assisted is not None:
            draft = self.drafts[mode.drafter]
            for name, value in self._default_assistant.items():
                setattr(draft.generation_config, name, value)
            if mode.assisted != "default":
                draft.generation_config.num_assistant_tokens = int(mode.assisted)
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                draft.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = draft
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(ids, streamer=timer, **kwargs)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        total_ms = (time.perf_counter() - start) * 1e3
        ttft_ms = ((timer.first_token_at or time.perf_counter()) - start) * 1e3
        return Sample(mode.name, "", temperature, 0, int(out.shape[1] - ids.shape[1]), total_ms, ttft_ms)
