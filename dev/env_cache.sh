# Sourced by dev/setup_venv*.sh: third-party packages are installed once per machine, the
# project once per clone.
#
# An environment of third-party packages ("deps") is defined by the files that install it (its
# install script, its pins) and the switches that change what it holds; their hash names a
# directory under PYKVCACHE_ENV_CACHE (default ~/.cache/pykvcache/envs; `none` keeps it inside
# the clone, under .env-cache/). It is marked complete only after its install succeeded, and
# built under a lock, so an interrupted or concurrent build is never reused half-made. It never
# holds pykvcache: a shared environment that held an editable install would point every clone
# at the tree that installed it last.
#
# The clone's own .venv is a small virtual environment of its own (no packages but the
# clone's pykvcache) whose site-packages adds the deps environment's through a .pth file: a
# clean clone on a machine that built the same deps before is set up in about a second, and
# two clones on one machine each import their own tree.

# env_key FILE...: the sha256 of what FILE... hold, the hash a deps environment is named by. The
# files are hashed as they read before this folder was renamed from tools/ to dev/ (each `dev/`
# path they name is hashed as `tools/`), so the environments built before the rename stay valid;
# any other change to them still names a new environment.
env_key() {
  cat "$@" | sed -E 's#(^|[^/[:alnum:]_.-])dev/#\1tools/#g' | sha256sum | cut -d' ' -f1
}

env_cache_dir() {
  local cache=${PYKVCACHE_ENV_CACHE:-$HOME/.cache/pykvcache/envs}
  if [ "$cache" = none ]; then cache=$PWD/.env-cache; fi
  echo "$cache"
}

# env_cache_deps NAME KEY INSTALL_CMD...: on return, DEPS_ENV names a complete deps environment
# for NAME-KEY; INSTALL_CMD (given the environment's path as its last argument) ran only if none
# existed. The build lock (fd 9) is held until the sourcing script exits.
env_cache_deps() {
  local name=$1 key=$2; shift 2
  local cache
  cache=$(env_cache_dir)
  mkdir -p "$cache"
  DEPS_ENV="$cache/$name-$key"
  exec 9>"$DEPS_ENV.lock"
  flock 9
  if [ -f "$DEPS_ENV/.pykvcache-complete" ]; then
    return 0
  fi
  rm -rf "$DEPS_ENV"  # half-made by an interrupted build: start over
  local start
  start=$(date +%s)
  "$@" "$DEPS_ENV"
  touch "$DEPS_ENV/.pykvcache-complete"
  echo "env_cache: built $DEPS_ENV in $(( $(date +%s) - start )) s" >&2
}

# env_layer VENV DEPS: makes VENV a virtual environment of the clone's own over DEPS's packages.
# An old-layout VENV (a link into the cache, or an environment that holds the packages itself)
# is replaced; a layer over the same DEPS is kept as it is.
env_layer() {
  local venv=$1 deps=$2
  local marker="$venv/.pykvcache-deps"
  if [ -L "$venv" ]; then
    rm -f "$venv"  # the link only, never what it points to
  fi
  if [ -x "$venv/bin/python" ] && [ "$(cat "$marker" 2>/dev/null)" = "$deps" ]; then
    return 0
  fi
  # From the deps environment's interpreter: venv creates the layer from the same base Python.
  "$deps/bin/python" -m venv --clear --without-pip "$venv"
  local site deps_site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  deps_site=$("$deps/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  # addsitedir (not a plain path line) so the deps' own .pth files are processed too; the
  # name sorts after pykvcache's editable .pth, so the clone's tree always comes first.
  printf 'import site; site.addsitedir(%s)\n' "$(printf '%s' "$deps_site" | "$venv/bin/python" -c 'import sys; print(repr(sys.stdin.read()))')" \
    > "$site/zz_pykvcache_deps.pth"
  # The deps' commands, run by the layer's interpreter (so `.venv/bin/pytest` sees this clone's
  # pykvcache): Python scripts are copied with their first line pointing here, native ones
  # (maturin, ruff) linked; `python -m maturin` looks for its binary in the layer's bin/.
  local f name first
  for f in "$deps"/bin/*; do
    name=$(basename "$f")
    case "$name" in python*|activate*|Activate*) continue ;; esac
    { [ -f "$f" ] && [ ! -e "$venv/bin/$name" ]; } || continue
    first=$(head -c 256 "$f" | head -n 1 | tr -d '\0')
    if [ "$first" = "#!$deps/bin/python" ] || [ "$first" = "#!$deps/bin/python3" ]; then
      { echo "#!$PWD/$venv/bin/python"; tail -n +2 "$f"; } > "$venv/bin/$name"
      chmod +x "$venv/bin/$name"
    else
      ln -s "$f" "$venv/bin/$name"
    fi
  done
  echo "$deps" > "$marker"
}
