"""An EAGLE-style draft head (issue 68): one decoder layer that drafts from its target's own
hidden features, in the two layouts the public releases use.

- EAGLE-1 (SafeAILab/EAGLE `cnets1.py`): the target's last hidden state after its final norm
  (`hidden_states[L]`), f_{p-1}, and the embedding of token p go through `fc` ([H, 2H], with a
  bias) as cat(embedding, feature), then one Llama decoder layer without its input norm
  (`layers.0.*`); its output g_p goes to the target's LM head unnormed, and is the feature the
  next step reads where the target has not given one.
- EAGLE-3 (EAGLE-3 releases, SGLang `llama_eagle3.py`): three target layers (`hidden_states`
  2, L // 2, L - 3) side by side, [3H], fused by `fc` ([H, 3H]); the layer (`midlayer.*`)
  attends over cat(input_layernorm(embedding), hidden_norm(feature)), [2H], with the fused
  feature as its residual; the sum it leaves is the next step's feature, and its own
  `norm` and `lm_head` over a draft vocabulary of Vd tokens give the logits. Draft row i is
  target token i + d2t[i].

How a session's positions line up (`specdec.engine.features.FeatureTrack`): the head's pass over token p of the
sequence reads the feature of position p - 1 (the target's where it was sent, else the
head's own prediction for p - 1, else zeros: position 0 and positions nobody computed) and
predicts the feature of p, whose logits draft token p + 1. Which feature a pass read only
moves how often drafts are accepted: every draft still travels with the exact distribution
it was drawn from (draft_service.stepping).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.engine.features import FeatureTrack
from specdec.engine.fingerprint import checkpoint_fingerprint

EAGLE1, EAGLE3 = "eagle1", "eagle3"
HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# What our own heads' config.json adds to the Llama fields (specdec.tools.train_head writes the
# kind, the layers and the checkpoint it trained on: specdec.engine.fingerprint's
# checkpoint_fingerprint of its --target; a weights fingerprint pins a head to one served
# target instead: weights, dtype and quantisation).
SPECDEC_KEYS = ("eagle_kind", "eagle_feature_layers", "target_weights_fingerprint", "target_checkpoint_fingerprint")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target hidden states an EAGLE-3 head fuses (transformers' numbering), as its releases
    pick them: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def _attention(config: LlamaConfig, width: int, qkv_bias: bool) -> LlamaAttention:
    """A Llama attention whose q, k and v read `width` features (EAGLE-3: 2H), with biases
    where the head has them (a Qwen2 EAGLE-1 head's `qkv_bias`); o_proj has none."""
    attention = LlamaAttention(config, layer_idx=0)
    heads, head_dim = int(config.num_attention_heads), int(attention.head_dim)
    kv_heads = int(config.num_key_value_heads or heads)
    attention.q_proj = nn.Linear(width, heads * head_dim, bias=qkv_bias)
    attention.k_proj = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
    attention.v_proj = nn.Linear(width, kv_heads * head_dim, bias=qkv_bias)
    return attention


class _Eagle1Layer(nn.Module):
    """EAGLE-1's decoder layer: a Llama layer whose input norm is left out."""

    def __init__(self, config: LlamaConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = _attention(config, config.hidden_size, qkv_bias)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, position_embeddings, mask, cache) -> torch.Tensor:
        attended, _ = self.self_attn(hidden, position_embeddings=position_embeddings, attention_mask=mask, cache=cache)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class _Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: attention over cat(normed embedding, normed feature), [2H]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.self_attn = _attention(config, 2 * width, qkv_bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)

    def forward(self, embeds, feature, position_embeddings, mask, cache) -> torch.Tensor:
        joined = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)  # [B, N, 2H]
        attended, _ = self.self_attn(joined, position_embeddings=position_embeddings, attention_mask=mask, cache=cache)
        hidden = feature + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    """The head as the model runners see a causal LM: `forward(input_ids, cache, cache_position,
    logits_to_keep)` → `.logits`, a one-layer Llama `config` for the KV pool, `dtype`. What it
    reads besides the tokens is each row's session's FeatureTrack, `feature_tracks`, which every
    pass hands it (specdec.engine.modeling.session_inputs): one session alone, or a batch of
    them padded as specdec.engine.batched_pass lays them out (real positions in
    `position_ids`, the new tokens' real columns in the last N of `attention_mask`)."""

    reads_features = True  # session_inputs: passes hand it their sessions' FeatureTracks

    def __init__(self, folder: HeadFolder, target_vocab: int) -> None:
        super().__init__()
        config, kind = folder.config, folder.kind
        self.config, self.kind = config, kind
        width = config.hidden_size
        self.embed_tokens = nn.Embedding(target_vocab, width)
        if kind == EAGLE1:
            self.fc = nn.Linear(2 * width, width, bias=folder.fc_bias)
            self.layers = nn.ModuleList([_Eagle1Layer(config, folder.qkv_bias)])
        else:
            self.fc = nn.Linear(3 * folder.target_width, width, bias=False)
            self.midlayer = _Eagle3Layer(config)
            self.norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        # The width of the target's rows it reads: H per layer it reads (EAGLE-3: three).
        self.feature_width = 3 * folder.target_width if kind == EAGLE3 else width
        self.lm_head = nn.Linear(width, folder.draft_vocab if kind == EAGLE3 else target_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype  # the Linear layers' may be packed (int8)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head  # type: ignore[assignment]

    def fuse(self, target_rows: torch.Tensor) -> torch.Tensor:
        """The target's features as the layer reads them: EAGLE-3's three layers through `fc`.
        [N, F] → [N, H]"""
        rows = target_rows.to(self.device, self.dtype)
        return self.fc(rows) if self.kind == EAGLE3 else rows

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N]
        cache=None,
        cache_position: torch.Tensor | None = None,  # [N]
        logits_to_keep: int | torch.Tensor = 0,
        attention_mask: torch.Tensor | None = None,  # [B, past + N], a batch's: 1 at real entries
        position_ids: torch.Tensor | None = None,  # [B, N], a batch's: each row's real positions
        use_cache: bool = True,
        feature_tracks: list[FeatureTrack] | None = None,  # [B]
        **_: object,
    ) -> SimpleNamespace:
        batch, width = input_ids.shape
        if feature_tracks is None or len(feature_tracks) != batch:
            raise AssertionError("every pass hands the head one FeatureTrack a row (session_inputs)")
        if position_ids is None:  # one session, its cache its own
            start = cache.get_seq_length() if cache is not None else 0
            first = torch.arange(start, start + width) if cache_position is None else cache_position.cpu()
            position_ids = first[None].to(input_ids.device)  # [1, N]
        positions = position_ids.tolist()  # B × [N]
        # A session no call opened (the calibration's copies) has no track: it reads zeros.
        feature_tracks = [track or FeatureTrack(self.config.hidden_size) for track in feature_tracks]
        # The new tokens' real columns: a batch's rows are right-padded to the widest.
        real = [width] * batch if attention_mask is None else attention_mask[:, -width:].sum(dim=1).tolist()  # [B]
        embeds = self.embed_tokens(input_ids)  # [B, N, H]
        feature = torch.stack(
            [track.inputs(row, embeds[b]) for b, (track, row) in enumerate(zip(feature_tracks, positions))]
        )
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        rotary = self.rotary_emb(embeds, position_ids=position_ids)
        if self.kind == EAGLE1:
            hidden = self.layers[0](self.fc(torch.cat([embeds, feature], dim=-1)), rotary, mask, cache)  # [B, N, H]
            normed = hidden
        else:
            hidden = self.midlayer(embeds, feature, rotary, mask, cache)  # [B, N, H]
            normed = self.norm(hidden)
        for b, (track, row) in enumerate(zip(feature_tracks, positions)):
            track.record(row[: real[b]], hidden[b, : real[b]])  # a pad's output is no prediction
        return SimpleNamespace(logits=self.lm_head(slice_logits_to_keep(normed, logits_to_keep)))  # [B, kept, Vd]


@dataclass(frozen=True)
class HeadFolder:
    """What a head's folder says of it (`read_head_config`)."""

    config: LlamaConfig
    kind: str
    feature_layers: tuple[int, ...]  # empty: the releases' choice for the target's depth
    draft_vocab: int
    target_weights_fingerprint: str  # "" where the folder does not say (a published head)
    target_width: int  # the target's hidden size (EAGLE-3's `target_hidden_size`; H where unsaid)
    fc_bias: bool  # EAGLE-1: `"bias": false` drops fc's bias (its LLaMA-3 heads)
    qkv_bias: bool  # EAGLE-1 heads for Qwen2 targets: q, k and v have biases
    target_vocab: int = 0  # the config's vocab_size: its target's vocabulary (0: unsaid)
    target_checkpoint_fingerprint: str = ""  # the checkpoint it was trained on; "" where unsaid


def read_head_config(folder: Path) -> HeadFolder:
    """A head folder's config.json: a Llama config with one layer, and the kind from the
    releases' `architectures` (…Eagle3… is EAGLE-3) or our own `eagle_kind`."""
    path = folder / HEAD_CONFIG
    if not path.is_file():
        raise ValueError(f"{folder} has no {HEAD_CONFIG}: not an EAGLE head folder")
    raw = json.loads(path.read_text())
    architectures = " ".join(raw.get("architectures") or [])
    kind = raw.get("eagle_kind") or (
        EAGLE3 if "eagle3" in architectures.lower() or "draft_vocab_size" in raw else EAGLE1
    )
    own = (*SPECDEC_KEYS, "architectures", "bias", "qkv_bias", "target_hidden_size", "draft_vocab_size")
    fields = {key: value for key, value in raw.items() if key not in own}
    fields["num_hidden_layers"] = 1
    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
    return HeadFolder(
        config,
        kind,
        tuple(
            raw.get("eagle_feature_layers")
            or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            or ()
        ),
        draft_vocab,
        str(raw.get("target_weights_fingerprint") or ""),
        int(raw.get("target_hidden_size") or config.hidden_size),
        bool(raw.get("bias", True)),
        bool(raw.get("qkv_bias", False)),
        int(raw.get("vocab_size") or 0),
        str(raw.get("target_checkpoint_fingerprint") or ""),
    )


def read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a checkpoint folder (safetensors, sharded or not, or a
    pytorch_model.bin), those it has; reads only them from safetensors files."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in set(names) & set(handle.keys()):
                found[name] = handle.get_tensor(name)
    if not files and (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        found = {name: state[name] for name in names if name in state}
    return found


def head_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head folder's weights: model.safetensors or its shards
    (model-00001-of-0000N.safetensors ...), or pytorch_model.bin. A weight stored in our
    compact form (int8 rows, `NAME.int8_scale` beside them: `save_compact`) comes back as
    float32."""
    shards = sorted(folder.glob("model*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for path in shards:
            state.update(load_file(str(path)))
        return _dequantized(state)
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} has none of {', '.join(HEAD_WEIGHTS)}: no head weights to load")


INT8_SCALE = ".int8_scale"
SHARD_BYTES = 19 << 20  # every file under 20 MB, the limit for a tracked file


def _dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name in [name for name in state if name.endswith(INT8_SCALE)]:
        weight = name.removesuffix(INT8_SCALE)
        state[weight] = state[weight].float() * state.pop(name).float()[:, None]  # [out, in]
    return state


def save_compact(state: dict[str, torch.Tensor], folder: Path, int8: bool) -> list[Path]:
    """A head's tensors as safetensors files of at most SHARD_BYTES each: 2-D weights as int8
    rows with a float16 scale per row (`int8`), or float16; vectors float16; integer and bool
    tensors as they are."""
    from safetensors.torch import save_file

    packed: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dim() == 2 and int8:
            scale = tensor.float().abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
            packed[name] = torch.round(tensor.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            packed[name + INT8_SCALE] = scale.to(torch.float16)
        elif tensor.is_floating_point():
            packed[name] = tensor.to(torch.float16).contiguous()
        else:
            packed[name] = tensor.contiguous()
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(packed, key=lambda key: (key.removesuffix(INT8_SCALE), key)):
        nbytes = packed[name].numel() * packed[name].element_size()
        if size + nbytes > SHARD_BYTES and groups[-1] and not name.endswith(INT8_SCALE):
            groups.append({})
            size = 0
        groups[-1][name] = packed[name]
        size += nbytes
    paths = []
    for index, group in enumerate(groups, 1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(folder / name))
        paths.append(folder / name)
    return paths


@dataclass(frozen=True)
class LoadedHead:
    head: EagleHead
    folder: HeadFolder
    feature_layers: tuple[int, ...]  # the target's hidden states it reads (specdec.engine.features)
    head_ids: torch.Tensor | None  # [Vd] ascending target ids of the head's rows (EAGLE-3); None: all V
    # The checkpoint whose features it reads: the one it was trained on, or, where its folder does
    # not say (a published head), the target folder's it runs with (checkpoint_fingerprint; "": none).
    target_checkpoint: str = ""


def load_head(head_dir: Path, target_dir: Path, target_config, dtype: torch.dtype, device: str) -> LoadedHead:
    """An EAGLE head from its folder, with the target's embedding and (EAGLE-1) LM head read
    from the target's folder where the head does not carry them. Published EAGLE-1 and EAGLE-3
    folders load as they are; a key missing or left over is an error naming it."""
    folder = read_head_config(head_dir)
    target_checkpoint = check_checkpoint(head_dir, folder, target_dir)
    target_layers = int(target_config.num_hidden_layers)
    target_vocab = int(target_config.vocab_size)
    state = {name.removeprefix("model."): tensor for name, tensor in head_state(head_dir).items()}
    t2d = state.pop("t2d", None)  # the membership mask d2t already says
    d2t = state.pop("d2t", None)
    check_vocabulary(head_dir, folder, target_vocab, t2d, d2t)
    head = EagleHead(folder, target_vocab)
    wanted = []
    if "embed_tokens.weight" not in state:
        wanted.append("model.embed_tokens.weight")
    if folder.kind == EAGLE1 and "lm_head.weight" not in state:
        wanted.append("lm_head.weight")
    head_ids = None
    if folder.kind == EAGLE3:
        draft_rows = torch.arange(folder.draft_vocab)
        head_ids = draft_rows if d2t is None else draft_rows + d2t.to(torch.int64)  # [Vd] target ids
        if bool((head_ids[1:] <= head_ids[:-1]).any()) or int(head_ids[0]) < 0 or int(head_ids[-1]) >= target_vocab:
            raise ValueError(f"{head_dir}: d2t does not map the draft rows to ascending ids below {target_vocab}")
        if "lm_head.weight" not in state:
            wanted.append("lm_head.weight")
    target = read_tensors(target_dir, wanted) if wanted else {}
    if "model.embed_tokens.weight" in wanted:
        if "model.embed_tokens.weight" not in target:
            raise ValueError(f"{target_dir} has no model.embed_tokens.weight for the head to embed tokens with")
        state["embed_tokens.weight"] = target["model.embed_tokens.weight"]
    if "lm_head.weight" in wanted:
        weight = target.get("lm_head.weight", state["embed_tokens.weight"])  # a tied target: its embedding
        state["lm_head.weight"] = weight if head_ids is None else weight[head_ids]
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(
            f"{head_dir} is not an {folder.kind} head of this shape: missing {sorted(missing)[:6]}, "
            f"unexpected {sorted(unexpected)[:6]}"
        )
    if head.embed_tokens.weight.shape != (target_vocab, folder.config.hidden_size):
        raise ValueError(
            f"the head embeds with [{target_vocab}, {folder.config.hidden_size}] rows; "
            f"{target_dir}'s embedding is {list(head.embed_tokens.weight.shape)}"
        )
    head.to(device=device, dtype=dtype).eval()
    head.requires_grad_(False)
    if folder.feature_layers:
        layers = folder.feature_layers
    else:
        layers = (target_layers,) if folder.kind == EAGLE1 else eagle3_layers(target_layers)
    outside = [layer for layer in layers if not 0 <= layer <= target_layers]
    width = len(layers) * int(target_config.hidden_size)
    if outside or width != head.feature_width:
        raise ValueError(
            f"{head_dir} reads the target's hidden states {list(layers)} ({head.feature_width} wide); the target "
            f"has states 0 to {target_layers}, {target_config.hidden_size} wide each ({width} for those layers)"
        )
    return LoadedHead(head, folder, tuple(layers), head_ids, target_checkpoint)


def check_vocabulary(head_dir: Path, folder: HeadFolder, vocab: int, t2d, d2t) -> None:
    """The head's vocabulary maps against the target's `vocab` ids: a head made for another
    vocabulary is refused by name, before any of its rows is read."""
    sizes = {"vocab_size": folder.target_vocab, "t2d": 0 if t2d is None else t2d.numel()}
    wrong = {name: size for name, size in sizes.items() if size and size != vocab}
    if wrong:
        raise ValueError(f"{head_dir} was made for a vocabulary of {wrong} ids; the target has {vocab}")
    if d2t is not None and d2t.numel() != folder.draft_vocab:
        raise ValueError(f"{head_dir}: d2t maps {d2t.numel()} rows; its draft_vocab_size is {folder.draft_vocab}")


def check_checkpoint(head_dir: Path, folder: HeadFolder, target_dir: Path) -> str:
    """A head trained on one checkpoint refuses to load beside another: its features and its
    embedding rows would not be the ones the head learned (the output would stay the target's,
    the drafts would mostly miss). → the checkpoint the head reads features of (LoadedHead)."""
    made_for = folder.target_checkpoint_fingerprint
    found = checkpoint_fingerprint(target_dir)
    if made_for and found and found != made_for:
        raise ValueError(
            f"{head_dir} was trained on the checkpoint whose fingerprint is {made_for[:16]}; {target_dir} holds "
            f"{found[:16]} (other weights, or the same saved in another dtype): train a head for it "
            "(python -m specdec.tools.train_head)"
        )
    return made_for or found
