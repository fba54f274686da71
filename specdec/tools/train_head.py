"""Train an EAGLE-3 head for a target by self-distillation (issue 68):

    python -m specdec.tools.train_head --target DIR --out DIR

1. Text any machine has: the Python standard library's sources and docstrings (or the files
   under --corpus), cut into windows of --seq-len tokens; and with --conversations N, N prompts
   written from the library's docstrings (requests to write, explain or use its functions, in
   the target's chat template, and story openers) followed by the target's own sampled answers
   (specdec.tools.conversations). Never the benchmark's prompts. --init starts from an earlier
   head (its weights and draft vocabulary), to train it on more of these.
2. The target runs over each window once; the hidden states the head will read (the inputs of
   layers 2, L // 2, L - 3) and its final hidden state (whose LM head gives the labels) are kept
   in bfloat16 shards under OUT/data, so a stopped run starts where it was.
3. The draft vocabulary: the --draft-vocab most frequent target tokens of that text, ascending.
4. The head learns the target's next-token distribution over that vocabulary, for the token
   after each of --steps-ahead draft steps: step 1 reads the target's features, step j the
   head's own predictions of step j - 1, and attends to the keys inference would hold then
   (EAGLE-3's training-time test). The LM head is the target's rows, frozen, and is not saved;
   the head's folder holds fc, midlayer, norm, d2t and t2d in float16, the command and the seed.

Resumable (OUT/train-state.pt every --save-every steps; --resume), seeded, with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.engine.eagle import EAGLE3, EagleHead, HeadFolder, eagle3_layers, head_state, read_tensors, save_compact
from specdec.engine.fingerprint import checkpoint_fingerprint
from specdec.tools.head_data import SHARD_WINDOWS, collect, draft_vocabulary

logger = logging.getLogger(__name__)
# Settings a --resume must share with the run it continues (train-state.pt records them).
RESUMED_SETTINGS = (
    *("steps", "lr", "warmup", "batch", "steps_ahead", "seed", "bf16", "windows", "seq_len"),
    *("conversations", "draft_vocab", "intermediate_size", "layers", "init"),
)


def head_config(target_config, args, layers: tuple[int, ...], draft_vocab: int) -> HeadFolder:
    text = target_config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(text, "rope_theta", 10000.0),
    }
    config = LlamaConfig(
        hidden_size=text.hidden_size,
        intermediate_size=args.intermediate_size,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        num_hidden_layers=1,
        rms_norm_eps=text.rms_norm_eps,
        vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    checkpoint = checkpoint_fingerprint(args.target)
    return HeadFolder(config, EAGLE3, layers, draft_vocab, "", text.hidden_size, False, False, 0, checkpoint)


def ttt_loss(
    head: EagleHead, target_head: torch.Tensor, batch: dict, steps: int, head_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[float]]:
    """The training-time test over a batch: the loss (steps weighted 0.8^(j-1)) and each step's
    top-1 agreement with the target. target_head: [Vd, H], the target's LM head rows, those of
    target ids `head_ids` [Vd]. Agreement is with the target's greedy token over its whole
    vocabulary (`batch["top"]`), as serving meets it: a slot whose token lies outside the
    draft vocabulary is a miss. Shards made before they carried it (or no `head_ids`) give the
    agreement with the target's likeliest draft-vocabulary token, which counts those slots as
    hits: an upper bound."""
    ids = batch["ids"].to(torch.int64)  # [B, T]
    features = batch["features"].float()  # [B, T, 3H]
    final = batch["final"].float()  # [B, T, H]
    length = ids.shape[1]
    layer, attention = head.midlayer, head.midlayer.self_attn
    embeds = head.embed_tokens(ids)  # [B, T, H]
    positions = torch.arange(length)[None]
    cos, sin = head.rotary_emb(embeds, position_ids=positions)
    with torch.no_grad():
        labels = torch.softmax(final @ target_head.T, dim=-1)  # [B, T, Vd]: slot s predicts token s + 1
        whole = "top" in batch and head_ids is not None
        greedy = batch["top"].to(torch.int64) if whole else labels.argmax(-1)  # [B, T]
    fused = head.fc(features)  # [B, T, H]
    feature = F.pad(fused[:, :-1], (0, 0, 1, 0))  # slot p reads position p - 1's; slot 0 zeros
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = torch.zeros(())
    agreement = []
    for step in range(1, steps + 1):
        joined = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], dim=-1)
        shape = (*joined.shape[:2], -1, attention.head_dim)
        query = attention.q_proj(joined).view(shape).transpose(1, 2)  # [B, nh, T, hd]
        key = attention.k_proj(joined).view(shape).transpose(1, 2)  # [B, nkv, T, hd]
        value = attention.v_proj(joined).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        keys.append(key)
        values.append(value)
        mask = _ttt_mask(length, step)  # [T, step · T]
        groups = attention.num_key_value_groups
        all_keys = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
        all_values = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(query, all_keys, all_values, attn_mask=mask, scale=attention.scaling)
        attended = attended.transpose(1, 2).reshape(*joined.shape[:2], -1)
        hidden = feature + attention.o_proj(attended)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # [B, T, H]
        logits = head.lm_head(head.norm(hidden))  # [B, T, Vd]
        valid = torch.zeros(length, dtype=torch.bool)
        valid[step - 1 : length - 1] = True  # slots with the keys inference would have, and a next token
        loss = -(labels * torch.log_softmax(logits, dim=-1)).sum(-1)[:, valid].mean()
        total = total + 0.8 ** (step - 1) * loss
        picked = logits.argmax(-1)  # [B, T]: draft rows, as target ids where compared over the whole vocabulary
        if whole and head_ids is not None:
            picked = head_ids[picked]
        agreement.append(float((picked == greedy)[:, valid].float().mean()))
        feature = F.pad(hidden[:, :-1], (0, 0, 1, 0))  # step j + 1's slot p reads this step's slot p - 1
    return total, agreement


def _ttt_mask(length: int, step: int) -> torch.Tensor:
    """Which keys slot s's query sees at draft step `step`: step 1's keys up to s - step + 1 (the
    slots the target's features reached), and step i's key at slot s - step + i for i = 2..step
    (the drafts since). [T, step · T] bool"""
    slots = torch.arange(length)
    blocks = [slots[None, :] <= (slots[:, None] - step + 1)]
    for i in range(2, step + 1):
        blocks.append(slots[None, :] == (slots[:, None] - step + i))
    return torch.cat(blocks, dim=1)


def export(
    head: EagleHead,
    folder: HeadFolder,
    head_ids: torch.Tensor,
    vocab: int,
    out: Path,
    trained_by: dict,
    int8: bool = False,
) -> None:
    """The head's folder as the loader reads it: config.json and safetensors files under 20 MB
    each (specdec.engine.eagle.save_compact): float16, or int8 rows with their scales."""
    state = {
        name: tensor.detach()
        for name, tensor in head.state_dict().items()
        if not name.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))
    }
    state["d2t"] = head_ids - torch.arange(len(head_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[head_ids] = True
    state["t2d"] = t2d
    for old in out.glob("model*.safetensors"):
        old.unlink()
    save_compact(state, out, int8)
    config = folder.config.to_dict()
    for key in ("architectures", "dtype", "torch_dtype", "transformers_version", "_attn_implementation_autoset"):
        config.pop(key, None)
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=len(head_ids),
        eagle_kind=EAGLE3,
        eagle_feature_layers=list(folder.feature_layers),
        trained_by=trained_by,
    )
    if folder.target_checkpoint_fingerprint:  # the loader and the coordinator refuse another checkpoint
        config["target_checkpoint_fingerprint"] = folder.target_checkpoint_fingerprint
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))


def train(args) -> Path:
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_config = AutoConfig.from_pretrained(args.target)
    num_layers = target_config.get_text_config().num_hidden_layers
    layers = tuple(args.layers) if args.layers else eagle3_layers(num_layers)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.target_dtype)).eval()
    paths = collect(args, target, tokenizer, layers)
    vocab = target_config.get_text_config().vocab_size
    eos = tuple(token for token in [tokenizer.eos_token_id] if token is not None)
    init = head_state(Path(args.init)) if args.init else None
    if init is not None:  # the earlier head's draft vocabulary, so its weights fit
        if init.get("t2d") is None or init["t2d"].numel() != vocab:
            raise SystemExit(f"--init {args.init}: not an EAGLE-3 head with a draft vocabulary over {vocab} ids")
        head_ids = init.pop("t2d").nonzero().flatten()
        init.pop("d2t", None)
    else:
        head_ids = draft_vocabulary(paths, args.draft_vocab, vocab, eos)
    folder = head_config(target_config, args, layers, len(head_ids))
    torch.manual_seed(args.seed)  # the head's first weights, whatever drew before (the answers)
    head = EagleHead(folder, vocab)
    if init is not None:
        missing, unexpected = head.load_state_dict(init, strict=False)
        if unexpected or any(not name.startswith(("embed_tokens.", "lm_head.")) for name in missing):
            raise SystemExit(f"--init {args.init}: its weights do not fit this head ({missing=}, {unexpected=})")
    weights = read_tensors(Path(args.target), ["model.embed_tokens.weight", "lm_head.weight"])
    with torch.no_grad():
        head.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
        head.lm_head = nn.Linear(lm_head.shape[1], len(head_ids), bias=False)
        head.lm_head.weight.copy_(lm_head[head_ids])
        head.norm.weight.copy_(target.model.norm.weight.float())
    del target
    target_head = head.lm_head.weight.detach()  # [Vd, H]: the labels' head and the draft's, frozen
    head.embed_tokens.requires_grad_(False)
    head.lm_head.requires_grad_(False)
    trainable = [param for param in head.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    start = 0
    state_path = out / "train-state.pt"
    # What a resumed run must share with the run it continues: its schedule, its data's order and
    # its head's shape and vocabulary (older states did not record them).
    settings = {name: getattr(args, name) for name in RESUMED_SETTINGS}
    if args.resume and state_path.is_file():
        saved = torch.load(state_path, weights_only=False)
        earlier = saved.get("settings", settings)
        if differ := {
            name: (earlier.get(name), value) for name, value in settings.items() if earlier.get(name, value) != value
        }:
            raise SystemExit(f"--resume: {state_path} was trained with other settings (then, now): {differ}")
        if saved["step"] >= args.steps and (out / "model.safetensors").is_file():
            logger.info("%s is trained already (%d steps): nothing to do", out, saved["step"])
            return out  # exported again, it would lose its recorded agreement
        head.load_state_dict(saved["head"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        start = saved["step"]
        logger.info("resumed at step %d", start)
    order = random.Random(args.seed)
    batches_per_epoch = [(shard, row) for shard in range(len(paths)) for row in range(SHARD_WINDOWS)]
    cache: dict[int, dict] = {}
    agreement: list[float] = []
    with tqdm(total=args.steps, initial=start, desc="head", unit="step") as bar:
        stop = args.steps if not args.stop_after else min(args.steps, start + args.stop_after)
        for step in range(start, stop):
            rows = _batch_rows(batches_per_epoch, step, args.batch, order, args.seed)
            batch = _gather(paths, rows, cache)
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, agreement = ttt_loss(head, target_head, batch, args.steps_ahead, head_ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 0.5)
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=" ".join(f"{a:.2f}" for a in agreement))
            bar.update(1)
            if (step + 1) % args.save_every == 0 or step + 1 == stop:
                trained = {
                    name: t
                    for name, t in head.state_dict().items()
                    if not name.startswith(("embed_tokens.", "lm_head."))
                }
                torch.save(
                    {
                        "head": trained,
                        "optimizer": optimizer.state_dict(),
                        "rng": torch.get_rng_state(),
                        "step": step + 1,
                        "settings": settings,
                    },
                    state_path.with_suffix(".tmp"),
                )
                state_path.with_suffix(".tmp").rename(state_path)
    if stop < args.steps:
        logger.info("stopped after step %d of %d; --resume continues", stop, args.steps)
        return out
    trained_by = {
        "command": "python -m specdec.tools.train_head " + " ".join(shlex.quote(arg) for arg in args.argv),
        "seed": args.seed,
        "steps": args.steps,
        "windows": args.windows,
        "conversations": args.conversations,
        "seq_len": args.seq_len,
        "top1_agreement_last_batch": [round(a, 3) for a in agreement],
        "finished": time.strftime("%Y-%m-%d"),
    }
    if args.init:  # the head it started from, and how that was made
        earlier = json.loads((Path(args.init) / "config.json").read_text()).get("trained_by", {})
        trained_by["init"] = {"folder": args.init, "trained_by": earlier}
    export(head, folder, head_ids, vocab, out, trained_by, int8=args.int8)
    return out


def _batch_rows(
    rows: list[tuple[int, int]], step: int, size: int, order: random.Random, seed: int
) -> list[tuple[int, int]]:
    """Step `step`'s windows: each epoch a seeded permutation of all, `size` at a time (a
    function of the step alone, so a resumed run draws what the straight run would)."""
    per_epoch = max(1, len(rows) // size)
    epoch, index = divmod(step, per_epoch)
    shuffled = list(rows)
    random.Random(seed * 1_000_003 + epoch).shuffle(shuffled)
    return shuffled[index * size : (index + 1) * size]


def _gather(paths: list[Path], rows: list[tuple[int, int]], cache: dict[int, dict]) -> dict:
    for shard, _ in rows:
        if shard not in cache:
            if len(cache) > 64:
                cache.pop(next(iter(cache)))
            cache[shard] = torch.load(paths[shard])
    keys = [key for key in ("ids", "features", "final", "top") if all(key in cache[shard] for shard, _ in rows)]
    return {key: torch.stack([cache[shard][key][row] for shard, row in rows]) for key in keys}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the target's model folder (safetensors)")
    parser.add_argument("--out", required=True, help="the head's folder (its data and train state go under it too)")
    parser.add_argument(
        "--corpus", default="", help="a folder of text files to learn from (default: the standard library's .py files)"
    )
    parser.add_argument("--windows", type=int, default=512, help="windows of --seq-len tokens the target runs over")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--draft-vocab", type=int, default=16384, help="tokens the head drafts from (the most frequent)"
    )
    parser.add_argument("--intermediate-size", type=int, default=2048, help="the head's MLP width")
    parser.add_argument(
        "--layers", type=int, nargs="*", default=None, help="target hidden states read (default 2, L // 2, L - 3)"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps-ahead", type=int, default=3, help="draft steps unrolled in training (EAGLE-3's test)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--target-dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="the target's dtype for the features",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="train under bfloat16 autocast (faster on CPUs with AVX512-BF16 or AMX)"
    )
    parser.add_argument(
        "--int8", action="store_true", help="save the weights as int8 rows with a scale each (half of float16)"
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=0,
        help="also train on this many prompts written from the standard library, answered by the target",
    )
    parser.add_argument("--answer-tokens", type=int, default=192, help="the longest answer the target writes")
    parser.add_argument("--answer-batch", type=int, default=16, help="prompts the target answers at once")
    parser.add_argument("--answer-temperature", type=float, default=0.7)
    parser.add_argument(
        "--init", default="", help="start from this head folder's weights and draft vocabulary (a fresh optimizer)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT/train-state.pt")
    parser.add_argument(
        "--stop-after", type=int, default=0, help="stop after this many steps of this run (then --resume)"
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in the head's config
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(train(parse_args(argv)))


if __name__ == "__main__":
    main()
