#!/usr/bin/env bash
# Prepares .gpu/, what a lease of a device machine carries to run `python -m bench.gpu_check`
# there (bench/profiles/README.md, "Measuring a card"). That machine reaches no package index
# and no model hub, and a lease carries 64 MiB:
#   .gpu/whl/     wheels for Python 3.12 of what its image lacks, or holds older than we need,
#                 at the versions installed in .venv here;
#   .gpu/models/  the real pair's configs and tokenizers without their weights: gpu_check gives
#                 each random weights of its shape there.
# Then it prints the device command. Run from the repository root after `make run` (.venv and
# .cache/models); the generated protos in specdec/v1 travel too (carry them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=.venv/bin/python
# Not in the device image ('cuda', bench/.library device KINDS.md), or older there than pyproject allows.
PACKAGES=(
  transformers huggingface-hub kernels httpx2 httpcore2 truststore tomlkit click hf-xet regex tokenizers
  grpcio grpcio-health-checking grpcio-reflection protobuf dnspython opentelemetry-exporter-otlp-proto-http
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  opentelemetry-instrumentation opentelemetry-instrumentation-grpc googleapis-common-protos
)
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/models
for name in "${PACKAGES[@]}"; do
  version=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .gpu/whl "$name==$version"
done
# Each model's folder keeps the model's name, which the profiles gpu_check writes carry.
target=$("$VENV_PY" -c "from specdec.tools.real_models import TARGET; print(TARGET.name)")
draft=$("$VENV_PY" -c "from specdec.tools.real_models import DRAFT; print(DRAFT.name)")
for name in "$target" "$draft"; do
  mkdir -p ".gpu/models/$name"
  for file in .cache/models/"$name"/*; do
    case "$(basename "$file")" in model*.safetensors*|pytorch_model*|specdec-ready) ;; *) cp "$file" ".gpu/models/$name/" ;; esac
  done
done
# The pair shares its tokenizer: the draft's files the target's have too travel as links.
for file in ".gpu/models/$draft"/*; do
  twin=".gpu/models/$target/$(basename "$file")"
  if cmp -s "$file" "$twin"; then ln -sf "../$target/$(basename "$file")" "$file"; fi
done
du -sh .gpu specdec/v1
# The captured passes first, bounded; then the rest, which saves after each step; then the
# compiled passes (--cuda-graphs compiled has never run on a card: its compile time is unknown),
# bounded, last. The random weights are made once (--work) for the three runs. A lease brings
# back at most 8 files: the logs and the compiled run's come back as one archive.
check="python3 -m bench.gpu_check --device cuda --dtype bfloat16 --target .gpu/models/$target --draft .gpu/models/$draft --work /tmp/gpu-work"
# Then, where the lease has a few minutes left, issue 66's framework cost per round where the
# three processes have cores to spare (this 2-core machine shares two among them): the
# overhead suite's tiny model on the device machine's CPUs.
setup="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD PYTHONUNBUFFERED=1"
cat <<EOF
Device command (carry: [".gpu", "specdec/v1"], timeout_s 570):
$setup && nvidia-smi -L && { timeout 170 $check --steps captured_against_eager --graph-settings off,on --out \$OUT/graphs; timeout 250 $check --steps profiles,services,transformers_generate,transformers_generate_static --logs /tmp/extra/logs --out \$OUT/rest; timeout 80 $check --steps captured_against_eager --graph-settings off,compiled --out /tmp/extra/compiled; tar czf \$OUT/extra.tgz -C /tmp extra; }
Then, with 3 minutes left (the same carry, timeout_s 150):
$setup && nproc && python3 -m bench --suite overhead --target-model .gpu/models/$target --repeats 1 --max-new-tokens 48 --out \$OUT/overhead
EOF
