#!/usr/bin/env bash
# Create the project virtual environment and install everything the package, its tests and the main job need.
# torch is pinned to a CPU build; fbgemm is chosen by whether that torch sees CUDA; torchrec goes in
# without its dependency list (it names the CUDA fbgemm-gpu package and pins an old torchmetrics), and last:
# pip does not check dependencies on a --no-deps install, but any later install would check torchrec's list
# against what is installed and report the two it leaves out on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
FBGEMM_VERSION=${FBGEMM_VERSION:-1.8.0}
TORCHREC_VERSION=${TORCHREC_VERSION:-1.8.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# numpy with torch: torch warns "Failed to initialize NumPy" when it is imported (below) without it
pip install "torch==${TORCH_VERSION}" "numpy>=1.24"
if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  fbgemm="fbgemm-gpu==${FBGEMM_VERSION}"
else
  fbgemm="fbgemm-gpu-cpu==${FBGEMM_VERSION}"
fi
pip install "$fbgemm"
pip install -e ".[dev]"
# matplotlib (benchmarks/plots.py, which adds this folder to its path when it draws) goes into a folder of its
# own, off the interpreter's path: once it is installed, torchmetrics imports matplotlib.pyplot in every process
# that imports Lightning (0.5 s of CPU each; the tests start about 250).
rm -rf "$VENV/plots"
pip install --target "$VENV/plots" "matplotlib>=3.8"
pip install --no-deps "torchrec==${TORCHREC_VERSION}"
"$VENV/bin/python" -c "import torchrec, fbgemm_gpu, lightning, torchrec_lookahead; print('environment ready:', '$fbgemm', 'torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '$TORCHREC_VERSION')"
