#!/usr/bin/env bash
# Creates (or reuses) .venv-vllm033: the released CUDA build of vLLM 0.33.0,
# installed exactly as GPU users install it (plain `pip install`, all of its
# requirements, CUDA torch 2.14.0 included), for `make test-vllm033`. No GPU
# is needed to install it or to run the tests that use it. Idempotent: a stamp
# keyed on the pinned requirements and this script skips the install when
# nothing changed; anything else rebuilds the environment from scratch.
# Measured (docs/vllm.md, "vLLM 0.33"): about 3 minutes and 9.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm033
REQ=tools/requirements-vllm033.txt
CONSTRAINTS=tools/constraints-vllm033.txt
key=$(cat "$REQ" "$CONSTRAINTS" "$0" | sha256sum | cut -c1-16)
# Once per machine (tools/env_cache.sh): .venv-vllm033 links to the environment for this key.
. tools/env_cache.sh
env_cache_link "$VENV" "$key"
stamp="$VENV/.pykvcache-env-$key"
if [ -f "$stamp" ] && "$VENV/bin/python" -c "import vllm, pytest" 2>/dev/null; then
  echo "setup_venv_vllm033: up to date ($stamp -> $ENV_CACHE_TARGET)"
  exit 0
fi
echo "setup_venv_vllm033: installing vllm==0.33.0 (CUDA build) into $ENV_CACHE_TARGET (about 3 minutes, 9.4 GB)" >&2
rm -rf "$ENV_CACHE_TARGET"
start=$(date +%s)
"$PY" -m venv "$ENV_CACHE_TARGET"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install -r "$REQ" -c "$CONSTRAINTS"
touch "$stamp"
env_cache_done
echo "setup_venv_vllm033: installed in $(( $(date +%s) - start )) s, $(du -sh "$ENV_CACHE_TARGET/" | cut -f1)"
