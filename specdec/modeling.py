"""Loading a causal LM and describing it; shared by the draft and target runners."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: str  # input device, e.g. "cpu" or "cuda:0"
    device_label: str  # what Info reports: the device, or "auto" for a device map
    vocab_size: int  # width of the logits
    eos_token_ids: tuple[int, ...]
    max_context: int
    tokenizer_fingerprint: str


def load_causal_lm(model_id: str, dtype: str, device: str, device_map: str | None = None) -> LoadedModel:
    """Loads a model folder (or hub id, where a hub is reachable) through transformers' own code.

    `device_map="auto"` lets accelerate spread the layers over the visible GPUs; inputs then go
    to the device of the first layer and the KV cache follows each layer.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    # Hub ids are "name" or "org/name"; anything else path-like must be an existing folder.
    looks_like_path = model_id.startswith((".", "/", "~")) or model_id.count("/") > 1
    if looks_like_path and not Path(model_id).expanduser().is_dir():
        raise ValueError(f"model folder {model_id!r} does not exist (pass a folder with config.json, or a hub id)")
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": False}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    if not device_map:
        model = model.to(device)
    model.eval()
    input_device = str(model.get_input_embeddings().weight.device)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 1 << 20
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        device=input_device,
        device_label=device_map or device,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_context=max_context,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )
    logger.info(
        "loaded %s: dtype=%s device=%s vocab=%d context=%d eos=%s tokenizer=%s",
        model_id, dtype, loaded.device_label, vocab_size, max_context, loaded.eos_token_ids,
        loaded.tokenizer_fingerprint[:12],
    )
    return loaded


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the generation config (what `generate` stops on), else the tokenizer's."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = tokenizer.eos_token_id
    if isinstance(configured, int):
        ids.append(configured)
    elif configured:
        ids.extend(int(i) for i in configured)
    return tuple(dict.fromkeys(ids))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the vocabulary and special tokens: two services with equal fingerprints
    map text to the same ids, which speculative decoding between them requires."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()
