#!/usr/bin/env bash
# vllm-router (the vLLM project's load balancer) into a PRIVATE directory, for
# `pykvcache cluster` and its test:
#   bash dev/setup_router.sh [DIR]                    (default: .vllm-router in the repo root)
#   pykvcache cluster --router-path DIR ...
# Users install it with pip (`pip install vllm-router==0.1.17`) and need no --router-path.
# Private here so that its dependencies never change vLLM's environment: --no-deps, and of its
# requirements (setproctitle, aiohttp, orjson, uvicorn, fastapi, requests) only orjson is
# missing from the venv. Pinned, so what the docs say of its routing stays true.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.vllm-router}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PINS=(vllm-router==0.1.17 orjson==3.11.5)
if [ ! -x "$PY" ]; then
  echo "setup_router: no Python at $PY (make venv first, or set PYTHON)" >&2
  exit 2
fi
if PYTHONPATH="$DIR" "$PY" -c "from importlib.metadata import version; assert version('vllm-router') == '0.1.17'; import vllm_router.launch_router, vllm_router_rs" 2>/dev/null; then
  echo "setup_router: vllm-router 0.1.17 already in $DIR"
  exit 0
fi
rm -rf "$DIR"
"$PY" -m pip install --disable-pip-version-check -q --no-deps --target "$DIR" "${PINS[@]}"
PYTHONPATH="$DIR" "$PY" -c "
import vllm_router.launch_router, vllm_router_rs
from importlib.metadata import version
print('vllm-router', version('vllm-router'), 'in', '$DIR')" 2>&1 | tail -1
