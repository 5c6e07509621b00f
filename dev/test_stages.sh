#!/usr/bin/env bash
# `make test`: every stage of the full suite in order, each timed, with a one-line summary per
# stage at the end (also when a stage fails), so a slow stage shows in every CI log.
#
#   venv      .venv (dev/setup_venv.sh: reused when its stamp matches)
#   build     the Rust extension into .venv (maturin develop --release)
#   lint      clippy -D warnings, cargo fmt --check, ruff check and format, mypy, stubtest of
#             _core.pyi (make lint: lint-code and typecheck)
#   lmcache   LMCache into .lmcache (the storage-level comparison's private install; in the
#             background from the end of build)
#   router    vllm-router into .vllm-router (`pykvcache cluster`'s test; in the background too)
#   cargo     cargo test (the engine alone; its binaries compile in the background during lint)
#   pytest    tests/ (real files, real io_uring, a real vLLM CPU build), slowest 30 printed
#   vllm033   the engine-free tests against vLLM 0.33's CUDA build (.venv-vllm033)
#   benches   the benchmark suite smoke-run once (tiny sizes, no timing)
#
# .venv-vllm033 (9.4 GB) is installed in the background while the Rust stages build and run:
# that install is network and disk work, the Rust stages are compiles; both are done before
# pytest starts.
# vllm033 and benches (engine-free, no timing asserted; ~130 s of CPU) run beside pytest, at
# nice 10: pytest's engine tests leave most of a core idle (their processes wait on each
# other), which these take; when pytest wants both cores the kernel gives it ~90% of them
# (weights 1024:110), so its timing-sensitive tests keep their cores. Their logs are printed
# after pytest's, each under its own stage line. PYKVCACHE_STAGES_SERIAL=1 runs them after.
# pytest itself runs on PYKVCACHE_TEST_WORKERS xdist workers (default 2; 0 = one process):
# a module's tests on one worker (its engine fixture starts once), tests/shared_fs and
# tests/tools each on one worker whole (tests/conftest.py; decision 0063).
# Every stage runs even after one fails (one CI log shows every failure); the exit status is
# the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
workers=${PYKVCACHE_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then xdist=(); else xdist=(-n "$workers" --dist loadscope); fi
summary=()
first_rc=0
suite_start=$(date +%s)

stage() {
  local name=$1; shift
  local start rc
  start=$(date +%s)
  echo "==== stage $name: $*"
  "$@"
  rc=$?
  local secs=$(( $(date +%s) - start ))
  summary+=("$(printf 'stage %-9s %5d s  %s' "$name" "$secs" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")")
  echo "==== stage $name: ${secs} s, exit $rc"
  if [ $rc -ne 0 ] && [ $first_rc -eq 0 ]; then first_rc=$rc; fi
  return $rc
}

print_summary() {
  echo "==== make test: per-stage wall time"
  printf '%s\n' "${summary[@]}"
  echo "stage total     $(( $(date +%s) - suite_start )) s"
}
trap print_summary EXIT

vllm033_env_log=$(mktemp)
skip033=${PYKVCACHE_SKIP_VLLM033:-0}

stage venv bash dev/setup_venv.sh || exit $first_rc
if [ "$skip033" != 1 ]; then
  { bash dev/setup_venv_vllm033.sh; rc=$?; date +%s >"$vllm033_env_log.end"; exit $rc; } >"$vllm033_env_log" 2>&1 &
  env033_pid=$!
  env033_start=$(date +%s)
fi
stage build make --no-print-directory develop || exit $first_rc
# The engine's test binaries compile (target/) while lint runs (mypy and stubtest use one core;
# clippy checks in target/maturin), and LMCache installs (network) meanwhile: each stage line
# then says how long it waited for its background part. Nothing of these runs beside pytest:
# its engine tests time reads on the same disk and cores (a CI run with the engine's tests
# beside it failed three of them).
background() {  # background NAME COMMAND...: runs it now, its log and exit status kept for `joined`
  local name=$1; shift
  { "$@"; echo $? >"$beside_bg/$name.rc"; } >"$beside_bg/$name.log" 2>&1 &
}
joined() {  # joined NAME: waits for the background part, prints its log, returns its status
  while [ ! -f "$beside_bg/$1.rc" ]; do sleep 0.2; done
  cat "$beside_bg/$1.log"
  return "$(cat "$beside_bg/$1.rc")"
}
beside_bg=$(mktemp -d)
background cargo_build cargo test --release --locked --no-run
background lmcache make --no-print-directory lmcache-env
background router make --no-print-directory router-env
stage lint make --no-print-directory lint
stage lmcache joined lmcache
stage router joined router
cargo_tests() { joined cargo_build && cargo test --release --locked; }
stage cargo cargo_tests
if [ "$skip033" != 1 ]; then
  wait_env033() { wait "$env033_pid"; local rc=$?; cat "$vllm033_env_log"; return $rc; }
  stage vllm033env wait_env033
  summary[-1]="${summary[-1]}  (the install itself: $(( $(cat "$vllm033_env_log.end" 2>/dev/null || date +%s) - env033_start )) s, in the background since the build)"
fi
after_pytest() {
  if [ "$skip033" = 1 ]; then
    echo "test-vllm033: SKIPPED (PYKVCACHE_SKIP_VLLM033=1): nothing ran against vLLM 0.33"
    summary+=("stage vllm033   SKIPPED (PYKVCACHE_SKIP_VLLM033=1)")
  else
    stage vllm033 make --no-print-directory test-vllm033
  fi
  stage benches "$PY" -m pytest -q benches --benchmark-disable
}

beside_dir=$(mktemp -d)
if [ "${PYKVCACHE_STAGES_SERIAL:-0}" = 1 ]; then
  stage pytest "$PY" -m pytest -q -ra --durations=30 "${xdist[@]}"
  after_pytest
else
  # The beside stages in a subshell at nice 10, their summary lines and exit status in files.
  (
    renice -n 10 -p "$BASHPID" >/dev/null  # before anything forks: every child inherits it
    summary=(); first_rc=0
    after_pytest
    printf '%s\n' "${summary[@]}" >"$beside_dir/summary"
    echo "$first_rc" >"$beside_dir/rc"
  ) >"$beside_dir/log" 2>&1 &
  beside_pid=$!
  stage pytest "$PY" -m pytest -q -ra --durations=30 "${xdist[@]}"
  if ! kill -0 "$beside_pid" 2>/dev/null; then beside_note="done before pytest"; else beside_note="waited for"; fi
  wait "$beside_pid"
  echo "==== beside pytest (nice 10), ${beside_note}: vllm033 and benches"
  cat "$beside_dir/log"
  while IFS= read -r line; do summary+=("$line  (beside pytest)"); done <"$beside_dir/summary"
  beside_rc=$(cat "$beside_dir/rc" 2>/dev/null || echo 1)
  if [ "$beside_rc" -ne 0 ] && [ "$first_rc" -eq 0 ]; then first_rc=$beside_rc; fi
fi
exit $first_rc
