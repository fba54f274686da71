"""The real Qwen2.5-Coder pair, when `make models` has prepared it (skipped otherwise, as in CI).

float32 target, as the exactness promise is stated for float32: greedy speculative output is
token-identical to the target alone and to transformers' own `generate`.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.tools.launch import local_stack
from specdec.tools.real_models import DRAFT, SMOLLM2, TARGET
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(os.environ.get("SPECDEC_MODELS_DIR", ROOT / ".cache/models"))
READY = all((MODELS_DIR / m.name / "specdec-ready").exists() for m in (DRAFT, TARGET))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not READY, reason=f"real pair not prepared in {MODELS_DIR} (make models)"),
]

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that reverses a linked list.<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):\n",
]
NEW_TOKENS = 24


def test_real_pair_greedy_is_exact(tmp_path):
    target_dir, draft_dir = MODELS_DIR / TARGET.name, MODELS_DIR / DRAFT.name
    with local_stack(
        draft_dir,
        target_dir,
        tmp_path,
        draft_dtype="bfloat16",
        target_dtype="float32",
        target_args=["--quantize", "none"],
        threads=2,
        cwd=ROOT,
    ) as services:
        with grpc.insecure_channel(services["coordinator"].address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            outputs = {
                (prompt, k): stub.Generate(
                    pb.GenerateRequest(prompt=prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=k), timeout=600
                )
                for prompt in PROMPTS
                for k in (0, 4)
            }

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        assert list(outputs[prompt, 0].token_ids) == expected
        assert list(outputs[prompt, 4].token_ids) == expected
        assert outputs[prompt, 4].stats.accepted_tokens > 0


@pytest.mark.skipif(
    not (MODELS_DIR / SMOLLM2.name / "specdec-ready").exists(),
    reason=f"SmolLM2 not prepared in {MODELS_DIR} (make models MODELS_EXTRA=smollm2)",
)
def test_a_draft_of_another_family_keeps_greedy_exact(tmp_path):
    """SmolLM2-135M (49,152 tokens) drafting for the Qwen target (151,665) within the tokens
    both share (--target-tokenizer): greedy output is the target's alone."""
    target_dir = MODELS_DIR / TARGET.name
    with local_stack(
        MODELS_DIR / SMOLLM2.name,
        target_dir,
        tmp_path,
        target_dtype="float32",
        target_args=["--quantize", "none"],
        draft_args=["--target-tokenizer", str(target_dir)],
        threads=2,
        cwd=ROOT,
    ) as services:
        with grpc.insecure_channel(services["coordinator"].address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for prompt in PROMPTS:
                request = pb.GenerateRequest(prompt=prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=0)
                alone = stub.Generate(request, timeout=600)
                request.num_speculative_tokens = 4
                drafted = stub.Generate(request, timeout=600)
                assert list(drafted.token_ids) == list(alone.token_ids)
                assert drafted.stats.accepted_tokens > 0 and drafted.stats.draft_failures == 0
