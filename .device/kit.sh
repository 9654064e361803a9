#!/usr/bin/env bash
# Builds .kit/: what this workplace's device machine needs to run hisparse and lacks. That machine has
# PyTorch, Triton and most of our dependencies but no network, and each call carries at most 64 MiB with the
# working tree (~14 MiB): the default model's 98 MB GGUF travels in parts over three calls (run.sh joins
# them), the missing packages as cp312 wheels. Run it here, from anywhere; then see .device/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${PART_MIB:-40}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "kit.sh: .venv is missing: run 'make setup' first" >&2; exit 2; }
gguf=$("$PY" -c "from hisparse.models.default_model import default_model_path; print(default_model_path())")
rm -rf .kit && mkdir -p .kit/wheels
split -b "${PART_MIB}M" -d -a 1 "$gguf" .kit/model.part
{ echo "name $(basename "$gguf")"; (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")"); } > .kit/manifest
# What the device machine's image lacks (its package list: /work/.library/device/KINDS.md), at our versions
# where we have them; their other needs are in the image. typing-extensions shadows an older one there.
pins=$("$PY" -m pip list --format=freeze 2>/dev/null \
       | grep -iE '^(fastapi|starlette|pydantic|pydantic[-_]core|annotated[-_]types|annotated[-_]doc|typing[-_]inspection|uvicorn|gguf|opentelemetry[-_]api|typing[-_]extensions)==' || true)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .kit/wheels $pins 2>&1 | grep -v "^WARNING: Location" || true
ls .kit/model.part* | xargs -n1 basename | sed 's/^/part /' >> .kit/manifest
echo "built .kit/: $(ls .kit/model.part* | wc -l) model parts of at most ${PART_MIB} MiB, $(ls .kit/wheels | wc -l) wheels"
du -sh .kit/model.part* .kit/wheels
