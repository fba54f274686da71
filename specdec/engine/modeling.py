"""Loading a causal LM and describing it; shared by the draft and target runners."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

if TYPE_CHECKING:
    # transformers' modeling stack takes seconds to import; the coordinator, which imports this
    # module for its tokenizer functions, never needs it (load_causal_lm imports it to load).
    from transformers import PreTrainedModel

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
    quantization: str = ""  # the Linear layers' quantisation as Info reports it ("" = none), e.g. int8's label
    tensor_parallel_size: int = 1  # ranks the weights and KV cache are split over (this process holds 1/N)
    checkpoint_fingerprint: str = ""  # of the folder's tensors as stored (fingerprint.checkpoint_fingerprint)


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword argument that hands `model` its KV cache: `cache` since transformers 5.24,
    where `past_key_values` is deprecated (a warning a pass; removed in 5.40), and
    `past_key_values` before. pyproject allows both sides of the rename."""
    model_class = type(model)
    keyword = _CACHE_KEYWORDS.get(model_class)
    if keyword is None:
        parameters = inspect.signature(model_class.forward).parameters
        keyword = _CACHE_KEYWORDS[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return {keyword: cache}


_CACHE_KEYWORDS: dict[type, str] = {}


def session_inputs(model: torch.nn.Module, sessions: list) -> dict:
    """What a pass hands `model` of its sessions (KVSession, one a row) beside their tokens and
    caches: an EAGLE head (specdec.engine.eagle, `reads_features`) reads each one's
    FeatureTrack; a causal LM reads nothing more."""
    if getattr(model, "reads_features", False):
        return {"feature_tracks": [session.features for session in sessions]}
    return {}


def check_device(device: str) -> None:
    """Before any weight is read: ValueError, in words, for a device this host cannot load onto
    (it failed with a traceback once the weights had loaded). "auto" is the device map's."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    visible = torch.cuda.device_count() if parsed.type == "cuda" and torch.cuda.is_available() else 0
    if parsed.type == "cuda" and (parsed.index or 0) >= visible:
        raise ValueError(f"--device {device}: this host has {visible} CUDA device(s) torch can use; use --device cpu")


def load_causal_lm(
    model_id: str,
    dtype: str,
    device: str,
    device_map: str | None = None,
    trust_remote_code: bool = False,
    tensor_parallel: int = 1,
) -> LoadedModel:
    """Loads a model folder (or hub id, where a hub is reachable) through transformers' own code;
    code shipped with the model runs only with `trust_remote_code` (a flag, off by default).

    `device_map="auto"` lets accelerate spread the layers over the visible GPUs; inputs then go
    to the device of the first layer and the KV cache follows each layer.

    `tensor_parallel` N > 1: this process is one of N ranks of an initialised torch.distributed
    group and loads its 1/N of every layer (transformers' tensor-parallel plan for the model);
    the KV cache it builds holds its 1/N of the heads.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    check_device(device_map or device)
    tokenizer = load_tokenizer(model_id, trust_remote_code)
    kwargs = _from_pretrained_kwargs(model_id, dtype, device_map, trust_remote_code, tensor_parallel)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    if not device_map and tensor_parallel == 1:
        model.to(device)  # type: ignore[arg-type]  # in place; transformers types to() by its decorator
    model.eval()
    loaded = _describe_loaded(model, tokenizer, model_id, device_map or device, tensor_parallel)
    logger.info(
        "loaded %s: dtype=%s device=%s vocab=%d context=%d eos=%s tokenizer=%s tensor_parallel=%d",
        model_id,
        dtype,
        loaded.device_label,
        loaded.vocab_size,
        loaded.max_context,
        loaded.eos_token_ids,
        loaded.tokenizer_fingerprint[:12],
        tensor_parallel,
    )
    return loaded


def _from_pretrained_kwargs(
    model_id: str, dtype: str, device_map: str | None, trust_remote_code: bool, tensor_parallel: int
) -> dict:
    """transformers' keyword arguments for loading the weights: the dtype, and the split of the
    layers over devices (`device_map`) or of each layer over tensor-parallel ranks, never both."""
    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if device_map and tensor_parallel > 1:
        raise ValueError("--device auto and --tensor-parallel are exclusive: choose one way to split the model")
    if device_map:
        kwargs["device_map"] = device_map
    if tensor_parallel > 1:
        from transformers.distributed import DistributedConfig

        check_tensor_parallel(
            AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code), tensor_parallel
        )
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tensor_parallel)
    return kwargs


def _describe_loaded(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_id: str,
    device_label: str,
    tensor_parallel: int,
) -> LoadedModel:
    """A placed model and its tokenizer as a LoadedModel: inputs go to the device of the input
    embeddings, the logits are as wide as the output head, and the EOS ids come from the
    generation config where the model has one."""
    from specdec.engine.fingerprint import checkpoint_fingerprint  # accelerate: not for the coordinator

    input_device = str(model.get_input_embeddings().weight.device)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 1 << 20
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        device=input_device,
        device_label=device_label,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids(getattr(model, "generation_config", None), tokenizer),
        max_context=max_context,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        tensor_parallel_size=tensor_parallel,
        checkpoint_fingerprint=checkpoint_fingerprint(model_id),
    )


def check_tensor_parallel(config, size: int) -> None:
    """Attention heads and KV heads are split evenly over the ranks, or not at all."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"{type(config).__name__} has no tensor-parallel plan in transformers; use --device auto instead"
        )
    if heads is None or kv_heads is None or heads % size or kv_heads % size:
        raise ValueError(
            f"--tensor-parallel {size} must divide the attention heads ({heads}) and the KV heads ({kv_heads}) of the "
            "model"
        )


def warn_if_trusting_remote_code(model_id: str, trust_remote_code: bool) -> None:
    if trust_remote_code:
        logger.warning("--trust-remote-code on: Python code shipped with %s may run in this process", model_id)


def load_tokenizer(model_id: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder (or hub id), refused by name where the path is no folder."""
    check_folder(model_id)
    warn_if_trusting_remote_code(model_id, trust_remote_code)
    return AutoTokenizer.from_pretrained(model_id, trust_remote_code=trust_remote_code)


def check_folder(model_id: str) -> None:
    # Hub ids are "name" or "org/name"; anything else path-like must be an existing folder.
    looks_like_path = model_id.startswith((".", "/", "~")) or model_id.count("/") > 1
    if looks_like_path and not Path(model_id).expanduser().is_dir():
        raise ValueError(f"model folder {model_id!r} does not exist (pass a folder with config.json, or a hub id)")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a model-free drafter needs to speak the target's ids: the tokenizer and the
    model's id space (its config's vocab size can exceed the tokenizer's length)."""

    tokenizer: PreTrainedTokenizerBase
    model_id: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    tokenizer_fingerprint: str


def load_tokenizer_info(model_id: str, trust_remote_code: bool = False) -> TokenizerInfo:
    """A model folder's tokenizer and id space, without loading any weights."""
    tokenizer = load_tokenizer(model_id, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        config = None  # a tokenizer-only folder
    try:
        generation_config = GenerationConfig.from_pretrained(model_id)
    except (OSError, ValueError):
        generation_config = None
    vocab_size = int(getattr(config, "vocab_size", 0) or len(tokenizer))
    max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 20
    return TokenizerInfo(
        tokenizer=tokenizer,
        model_id=model_id,
        vocab_size=max(vocab_size, len(tokenizer)),
        eos_token_ids=eos_token_ids(generation_config, tokenizer),
        max_context=max_context,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )


def restrict_output_head(model: PreTrainedModel, keep_ids: torch.Tensor) -> None:
    """Replaces the output head by one over `keep_ids` only ([N] int64, ascending), so each
    step computes N logits instead of V. The head's row i then scores token keep_ids[i]."""
    head = model.get_output_embeddings()
    weight = head.weight.detach()[keep_ids].clone()  # [N, hidden]
    reduced = torch.nn.Linear(
        weight.shape[1], weight.shape[0], bias=head.bias is not None, device=weight.device, dtype=weight.dtype
    )
    reduced.weight = torch.nn.Parameter(weight, requires_grad=False)
    if head.bias is not None:
        reduced.bias = torch.nn.Parameter(head.bias.detach()[keep_ids].clone(), requires_grad=False)
    # Untie first: the input embeddings must keep every row.
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(reduced)


def eos_token_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the generation config (what `generate` stops on), else the tokenizer's."""
    ids: list[int] = []
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


def frequent_token_ids(tokenizer, vocab_size: int, keep: int, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """The `keep` lowest ids plus every special and EOS id: [N] int64, ascending.

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) number tokens in merge order, and
    merges are learned most-frequent first, so low ids approximate the most frequent tokens
    without a corpus. Special tokens stay so the draft can still propose the end of a turn.
    """
    if not 0 < keep < vocab_size:
        raise ValueError(f"the reduced vocabulary must keep between 1 and {vocab_size - 1} ids; got {keep}")
    special = {int(i) for i in tokenizer.all_special_ids} | set(eos_token_ids)
    ids = set(range(keep)) | {i for i in special if 0 <= i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)
