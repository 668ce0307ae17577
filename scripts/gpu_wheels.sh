#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels that a GPU machine without network needs on top of its own
# torch 2.11 (CUDA 13), Lightning and the rest: fbgemm-gpu 1.6.0 (the CUDA 13 build for torch 2.11), torchrec
# 1.6.1 and the pure-Python packages of torchrec and of this package that such a machine lacks.
# fbgemm-gpu's wheel is 465 MB: scripts/prune_fatbin.py keeps its sm_90 device code (H100 / H200), drops the
# device code of what training here never launches (inference TBE; SSD, VBE and global-weight-decay kernels;
# the LAMB, LARS and counter-Adagrad backward kernels) and writes it again with LZMA: about 40 MB. A launch of
# a dropped kernel fails with "no kernel image is available for execution on the device".
# scripts/gpu_check.sh installs them on the GPU machine and runs benchmarks/gpu_suite.py.
#   bash scripts/gpu_wheels.sh            # from the repository root; needs PyPI and python3 >= 3.10
#   ARCH=100 bash scripts/gpu_wheels.sh   # another GPU (sm_100: B200)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCH=${ARCH:-90}
DEST=${DEST:-.whl}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$DEST"
download() {
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --index-url https://pypi.org/simple -d "$1" "${@:2}"
}
# pure Python; versions as in the project's own environment (iopath 0.1.10 has no wheel: 0.1.9 is the same code
# for what torchrec uses)
download "$DEST" torchrec==1.6.1 tensordict==0.15.3 pyvers==0.2.3 iopath==0.1.9 \
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
if [ -n "${FBGEMM_WHEEL:-}" ]; then  # an earlier download of fbgemm_gpu-1.6.0-cp312-...whl
  cp "$FBGEMM_WHEEL" "$WORK/"
else
  download "$WORK" fbgemm-gpu==1.6.0
fi
# zstandard reads the zstd-compressed cubins, whose symbols name the CUDA source a container was built from
"$PY" -c "import zstandard" 2>/dev/null || "$PY" -m pip install -q zstandard || true
"$PY" scripts/prune_fatbin.py "$WORK"/fbgemm_gpu-1.6.0-*.whl "$DEST/$(basename "$WORK"/fbgemm_gpu-1.6.0-*.whl)" \
  --arch "$ARCH" \
  --drop-lib fbgemm_gpu_tbe_inference fbgemm_gpu_tbe_training_backward_gwd fbgemm_gpu_tbe_training_backward_vbe \
  --drop-source '_(ssd|vbe|gwd)_|lamb|lars|with_counter'
du -sh "$DEST"
ls -l "$DEST"
