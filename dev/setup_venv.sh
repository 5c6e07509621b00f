#!/usr/bin/env bash
# Creates (or reuses) .venv with everything `make test` and `make demo` need: the clone's own
# small environment over a per-machine environment of third-party packages (dev/env_cache.sh;
# what it holds: dev/install_deps.sh). `make develop` then installs this clone's pykvcache into
# .venv alone.
set -euo pipefail
cd "$(dirname "$0")/.."
. dev/env_cache.sh
# The deps environment is named by what installs it and whether vLLM is in.
key="$(env_key dev/install_deps.sh dev/requirements-dev.txt | cut -c1-12)-vllm${PYKVCACHE_SKIP_VLLM:-0}"
env_cache_deps deps "$key" bash dev/install_deps.sh
env_layer .venv "$DEPS_ENV"
.venv/bin/python -c "import sys; print('setup_venv: ok', sys.version.split()[0], '(' + sys.prefix + ' over $DEPS_ENV)')"
