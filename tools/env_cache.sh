# Sourced by tools/setup_venv*.sh: environments are built once per machine, not per clone.
#
# An environment is defined by the files that install it (its setup script, its pins) and
# the switches that change what it holds; their hash names a directory under
# PYKVCACHE_ENV_CACHE (default ~/.cache/pykvcache/envs) and the clone's .venv* becomes a link
# to it. A clean clone on a machine that built the same environment before links it in
# seconds; a fresh machine (or a changed pin) builds it, exactly as before. The environment
# is marked complete only after its install succeeded, and built under a lock, so an
# interrupted or concurrent build is never reused half-made.
# PYKVCACHE_ENV_CACHE=none keeps the environment inside the clone (the old layout).
#
# The editable install of pykvcache (`make develop`) points the environment at the clone
# that ran it last: every `make` target that runs tests runs `develop` first, so the
# environment always tests the clone it was called from (one clone at a time per machine).

# env_cache_link VENV KEY: on return, VENV is either a directory of the clone's own (left
# as it is: an existing in-clone environment keeps working) or a link to the cached
# environment for KEY. Sets ENV_CACHE_TARGET to the real path and holds the build lock
# (fd 9) until the sourcing script exits.
env_cache_link() {
  local venv=$1 key=$2
  local cache=${PYKVCACHE_ENV_CACHE:-$HOME/.cache/pykvcache/envs}
  ENV_CACHE_TARGET=$venv
  if [ "$cache" = none ] || { [ -e "$venv" ] && [ ! -L "$venv" ]; }; then
    return 0
  fi
  mkdir -p "$cache"
  local name
  name="$(basename "$venv" | sed 's/^\.//')-$key"
  ENV_CACHE_TARGET="$cache/$name"
  exec 9>"$cache/$name.lock"
  flock 9
  if [ ! -f "$ENV_CACHE_TARGET/.pykvcache-complete" ]; then
    rm -rf "$ENV_CACHE_TARGET"  # half-made by an interrupted build: start over
  fi
  ln -sfn "$ENV_CACHE_TARGET" "$venv"
}

# env_cache_done: the environment's install succeeded; later clones may reuse it.
env_cache_done() {
  touch "$ENV_CACHE_TARGET/.pykvcache-complete"
}
