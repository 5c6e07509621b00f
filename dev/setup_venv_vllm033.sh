#!/usr/bin/env bash
# Creates (or reuses) .venv-vllm033: the released CUDA build of vLLM 0.33.0, installed exactly as
# GPU users install it (plain `pip install`, all of its requirements, CUDA torch 2.14.0
# included), for `make test-vllm033`; no GPU is needed to install it or to run the tests that use
# it. As .venv (dev/env_cache.sh): the packages once per machine, keyed on the pins, and a
# small environment of the clone's own over them, into which `make test-vllm033` installs the
# clone's wheel. Measured (docs/vllm.md, "vLLM 0.33"): about 3 minutes and 9.4 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=dev/requirements-vllm033.txt
CONSTRAINTS=dev/constraints-vllm033.txt
. dev/env_cache.sh
install_vllm033() {
  echo "setup_venv_vllm033: installing vllm==0.33.0 (CUDA build) into $1 (about 3 minutes, 9.4 GB)" >&2
  "${PYTHON:-python3}" -m venv "$1"
  "$1/bin/python" -m pip --disable-pip-version-check -q install -r "$REQ" -c "$CONSTRAINTS"
}
env_cache_deps deps-vllm033 "$(env_key "$REQ" "$CONSTRAINTS" | cut -c1-16)" install_vllm033
env_layer .venv-vllm033 "$DEPS_ENV"
echo "setup_venv_vllm033: ok (.venv-vllm033 over $DEPS_ENV)"
