#!/usr/bin/env bash
# On a GPU machine without network (python3 with a CUDA torch 2.11, Lightning, ...): install the wheels of
# .whl/ (scripts/gpu_wheels.sh) into /tmp/site and run every GPU check and figure (benchmarks/gpu_suite.py).
#   bash scripts/gpu_check.sh "$OUT"            # writes $OUT/gpu_suite.json, $OUT/gpu_suite.log
#   bash scripts/gpu_check.sh "$OUT" --cpu-smoke
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: gpu_check.sh OUT_DIR [gpu_suite.py options]}
shift
mkdir -p "$OUT_DIR"
SITE=${SITE:-/tmp/site}
if [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    > "$OUT_DIR/pip_install.log" 2>&1 || { echo "wheel install failed: $OUT_DIR/pip_install.log"; tail -20 "$OUT_DIR/pip_install.log"; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 benchmarks/gpu_suite.py --out "$OUT_DIR" "$@"
