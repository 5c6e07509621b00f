#!/usr/bin/env bash
# `make develop`: builds the Rust extension (release) into this clone's .venv as an editable
# install, unless nothing it is built from changed since the last build of this clone (maturin
# develop took 12-30 s even then: every `make test-quick`).
#
# The build has a target directory of its own (target/maturin; PYKVCACHE_MATURIN_TARGET names
# another, e.g. a second clone reusing a first one's dependency builds): `cargo test` builds the
# same crate without the `python` feature into target/, and sharing one directory made each of
# them rebuild the crate after the other (the cdylib's output file is shared: ~40 s of every
# inner loop).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export CARGO_TARGET_DIR=${PYKVCACHE_MATURIN_TARGET:-target/maturin}
# The stamp lives in the clone's own environment (dev/env_cache.sh), so it vouches for this
# environment holding this clone's build whatever target directory built it.
stamp=.venv/.pykvcache-develop-stamp
want="$(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && [ -z "$(find rust Cargo.toml Cargo.lock pyproject.toml -newer "$stamp" -print -quit)" ] \
   && ls python/pykvcache/_core*.so >/dev/null 2>&1 \
   && "$PY" -c "import os, sys, pykvcache; sys.exit(os.path.dirname(pykvcache.__file__) != os.path.realpath('python/pykvcache'))" 2>/dev/null; then
  echo "develop: up to date (nothing under rust/, Cargo.*, pyproject.toml changed since the last build)"
  exit 0
fi
rm -f "$stamp" python/pykvcache/_core.cpython-*.so  # pre-abi3 builds would shadow the new one
# `python` (pyproject.toml's maturin features, which --features replaces) and the engine's test
# hooks (the tests' `_fault_*` keywords); `make wheel` builds without the hooks.
"$PY" -m maturin develop --release --quiet --features python,fault-injection
echo "$want" > "$stamp"
