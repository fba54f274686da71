"""Tiny model pairs the tests build themselves: transformers' Qwen2 classes with random
weights, tokenizers built with the `tokenizers` library, saved with `save_pretrained` and
loaded back by the services through their real `--model` path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EOS = "<|endoftext|>"
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "for i in range(10):\n    print(i * i)\n",
    "Résumé: naïve café — ünïcödé text, 東京 and emojis 🙂 too.",
] * 20


@dataclass(frozen=True)
class TinyPair:
    target: Path
    draft: Path
    vocab_size: int
    eos_token_id: int | None


# ChatML, as Qwen's instruct models write it, in plain text (the tiny vocabulary has no
# special tokens for the markers), so chat requests go through a real template.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(
    vocab_size: int = 320, corpus: list[str] = CORPUS, special_tokens: tuple[str, ...] = (EOS,)
) -> PreTrainedTokenizerFast:
    """A byte-level BPE like Qwen's: encodes any text, splits multi-byte characters. Another
    `corpus` or `special_tokens` gives another tokenizer over the same bytes (other merges,
    other ids), as a draft of another family has."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def sentencepiece_tokenizer(layout: str = "llama2", vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (▁ for a space, <0xNN> byte fallback), in the tokenizer.json
    layout of Llama 2, Mistral and Phi-3 ("llama2": a normalizer writes the ▁, the decoder
    undoes it and strips the first space; no Metaspace anywhere) or of newer conversions
    ("metaspace": Metaspace pre-tokenizer and decoder)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if layout == "llama2":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        fused = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        tokenizer.decoder = decoders.Sequence(fused)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([text for text in CORPUS if "東" not in text], trainer)  # 東京 left to bytes
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # the byte-fallback pieces, as SentencePiece models carry them
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    built = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=built, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def word_tokenizer(num_words: int, words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Words w0..w{n-1}: a vocabulary small enough for exact distribution tests. `words`: these
    words instead, in this order (the first is the unknown word)."""
    words = words if words is not None else [f"w{i}" for i in range(num_words)]
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])


def build_model(
    folder: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    logit_scale: float,
    eos_token_id: int | None,
    base: Qwen2ForCausalLM | None = None,
    noise: float = 0.0,
    max_context: int = 512,
    layers: int = 2,
    extra_vocab: int = 0,
) -> Qwen2ForCausalLM:
    """Random Qwen2; with `base`, a noisy copy of it (a draft that agrees often, not always).
    `logit_scale` sets the logits' spread so distributions are peaked, not uniform.
    `extra_vocab` widens the embeddings and logits past the tokenizer (as Qwen2.5-7B's 152,064
    columns are wider than its tokenizer and than 0.5B's 151,936); a copy of a base of another
    width shares the rows both have."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer) + extra_vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        if base is not None:
            own = model.state_dict()
            for name, value in base.state_dict().items():
                if value.shape == own[name].shape:
                    own[name].copy_(value)
                else:  # embeddings or output head of another width: the rows both have
                    rows = min(value.shape[0], own[name].shape[0])
                    own[name][:rows].copy_(value[:rows])
            model.load_state_dict(own)
            for param in model.parameters():
                param.add_(torch.randn_like(param) * noise * (param.std() if param.numel() > 1 else 1.0))
        else:
            # Hidden states leave the final RMSNorm with unit scale, so logits get std ≈ logit_scale.
            model.lm_head.weight.normal_(0.0, logit_scale / config.hidden_size**0.5)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def build_pair(
    root: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    logit_scale: float,
    noise: float,
    eos: bool,
    max_context: int = 512,
    target_extra_vocab: int = 0,
    draft_extra_vocab: int = 0,
) -> TinyPair:
    """`target_extra_vocab`, `draft_extra_vocab`: logit columns past the tokenizer's, so the
    two models' widths can differ as real pairs' do; the target samples its extra ids too."""
    eos_token_id = tokenizer.get_vocab()[EOS] if eos else None
    target = build_model(
        root / "target",
        tokenizer,
        seed=0,
        logit_scale=logit_scale,
        eos_token_id=eos_token_id,
        max_context=max_context,
        extra_vocab=target_extra_vocab,
    )
    build_model(
        root / "draft",
        tokenizer,
        seed=1,
        logit_scale=1.0,
        eos_token_id=eos_token_id,
        base=target,
        noise=noise,
        max_context=max_context,
        extra_vocab=draft_extra_vocab,
    )
    return TinyPair(root / "target", root / "draft", len(tokenizer) + target_extra_vocab, eos_token_id)


# Text in another style, so a draft tokenizer trained on it merges other byte pairs.
DRAFT_CORPUS = [
    "def subtract(x, y):\n    return x - y\n",
    "A quick red fox ran over the sleeping dogs.",
    "while True:\n    print('tokens', count)\n",
    "Résumé of the café menu: crème brûlée, 東京 sushi 🙂.",
] * 20


def build_bridged_draft(
    folder: Path, tokenizer: PreTrainedTokenizerFast, target: Path, *, noise: float, seed: int = 2
) -> Qwen2ForCausalLM:
    """A draft with its own tokenizer for the target in `target`: a noisy copy of the target
    whose embedding and output rows of tokens both vocabularies hold (the same string) are
    the target's rows of that token, so it agrees with the target where it can."""
    base = Qwen2ForCausalLM.from_pretrained(target)
    target_vocab = PreTrainedTokenizerFast.from_pretrained(target).get_vocab()
    model = build_model(
        folder,
        tokenizer,
        seed=seed,
        logit_scale=1.0,
        eos_token_id=tokenizer.eos_token_id,
        max_context=base.config.max_position_embeddings,
        layers=base.config.num_hidden_layers,
    )
    with torch.no_grad():
        own = model.state_dict()
        for name, value in base.state_dict().items():
            if value.shape == own[name].shape:
                own[name].copy_(value + torch.randn_like(value) * noise * (value.std() if value.numel() > 1 else 1.0))
        for token, draft_id in tokenizer.get_vocab().items():
            if token in target_vocab:
                for name in ("model.embed_tokens.weight", "lm_head.weight"):
                    own[name][draft_id] = base.state_dict()[name][target_vocab[token]]
        model.load_state_dict(own)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def build_eagle_head(folder: Path, target: Path, kind: str, *, seed: int = 0, draft_vocab: int = 0) -> Path:
    """A random EAGLE head for the tiny target in `target`, written as the public releases write
    theirs: EAGLE-1 a `pytorch_model.bin` with `fc` (biased), `layers.0.*` and a copy of the
    target's embedding; EAGLE-3 a `model.safetensors` with `fc`, `midlayer.*`, `norm`, an
    `lm_head` over `draft_vocab` tokens (0: all), `d2t` and `t2d`, without the embedding. The
    target's hidden states it reads: EAGLE-3 the embeddings', the middle and the final norm's
    (a tiny target has too few layers for the releases' choice), EAGLE-1 the final norm's."""
    import json

    from safetensors.torch import save_file

    from specdec.engine.eagle import EAGLE3, EagleHead, read_head_config

    base = Qwen2ForCausalLM.from_pretrained(target)
    vocab, width = base.config.vocab_size, base.config.hidden_size
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == EAGLE3 else "LlamaForCausalLM"],
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": base.config.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    draft_rows = draft_vocab or vocab
    if kind == EAGLE3:
        config["draft_vocab_size"] = draft_rows
        layers = base.config.num_hidden_layers
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(seed)
    head = EagleHead(read_head_config(folder), vocab)
    state = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    state["embed_tokens.weight"] = base.model.embed_tokens.weight.detach().clone()
    if kind == EAGLE3:
        del state["embed_tokens.weight"]
        used = torch.arange(draft_rows) * vocab // draft_rows  # ascending
        state["lm_head.weight"] = base.lm_head.weight.detach()[used].clone() + 0.05 * torch.randn(len(used), width)
        state["d2t"] = used - torch.arange(len(used))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
        state["t2d"] = t2d
        save_file(state, str(folder / "model.safetensors"))
    else:
        del state["lm_head.weight"]  # EAGLE-1 uses its target's
        torch.save(state, folder / "pytorch_model.bin")
    return folder
