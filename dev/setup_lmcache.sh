#!/usr/bin/env bash
# LMCache into a PRIVATE directory, for the benchmark's LMCache comparisons
# (`pykvcache bench --parts lmcache_disk`, the serve part's `lmcache` config):
#   bash dev/setup_lmcache.sh [DIR]          (default: .lmcache in the repo root)
#   PYKVCACHE_LMCACHE_PATH=DIR pykvcache bench --parts lmcache_disk --out OUT
# Never into the venv: LMCache pins numpy<=2.2.6, transformers>=5.4, cupy, ... that
# would change vLLM's environment under the other tests. --no-deps, so the only
# packages added are the ones LMCache's storage layer imports that vLLM's venv
# does not already have (aiofile and its caio); everything else (torch, numpy,
# msgspec, prometheus_client, ...) comes from the venv. Pinned, so the
# comparison is repeatable. The wheel is cp311 manylinux: the venv's Python must be 3.11.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.lmcache}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PINS=(lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10)
if [ ! -x "$PY" ]; then
  echo "setup_lmcache: no Python at $PY (make venv first, or set PYTHON)" >&2
  exit 2
fi

# A half-finished earlier install must not be mixed with this one.
rm -rf "$DIR"
"$PY" -m pip install --disable-pip-version-check -q --no-deps --target "$DIR" "${PINS[@]}"
# Proof that it works: LMCache's storage manager, disk backend and allocator import.
PYTHONPATH="$DIR" "$PY" -c "
import lmcache.v1.storage_backend.storage_manager, lmcache.v1.storage_backend.local_disk_backend
from importlib.metadata import version
print('lmcache', version('lmcache'), 'in', '$DIR')" 2>&1 | tail -1
du -sh "$DIR"
