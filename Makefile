# The two entry points: `make demo` and `make test`. Both set up .venv themselves.
VENV := .venv
PY := $(VENV)/bin/python
# The CUDA build of vLLM 0.33 that GPU users install, beside the CPU build in .venv.
VENV033 := .venv-vllm033
export HF_HUB_OFFLINE := 1
export VLLM_CPU_OMP_THREADS_BIND := nobind

.PHONY: venv venv-vllm033 lmcache-env router-env develop wheel lint lint-code typecheck test test-quick test-rust test-python test-vllm033 demo bench bench-serve bench-serve-long clean

venv:
	bash dev/setup_venv.sh

# Builds the Rust extension (release) into the venv; a no-op when nothing it is built
# from changed (dev/develop.sh; its own target directory, target/maturin).
develop: venv
	bash dev/develop.sh

# One abi3 wheel (CPython >= 3.11, manylinux) in dist/: what users install, so without the
# engine's test hooks (cargo feature fault-injection, which `develop` adds for the tests).
wheel: venv
	rm -f dist/pykvcache-*.whl
	CARGO_TARGET_DIR=target/maturin $(VENV)/bin/maturin build --release --quiet --out dist

venv-vllm033:
	bash dev/setup_venv_vllm033.sh

# LMCache in .lmcache (never the venv), for `pykvcache bench --parts lmcache_disk`
# and the serve part's lmcache config: ~20 MB download, ~100 MB on disk, seconds.
lmcache-env:
	bash dev/setup_lmcache.sh .lmcache

# vllm-router in .vllm-router (never the venv), for `pykvcache cluster --router-path .vllm-router`
# and its test: ~20 MB download, 70 MB on disk, seconds.
router-env:
	bash dev/setup_router.sh .vllm-router

# The lint gates (stage `lint` of `make test`, after `build`): `lint-code`: clippy with warnings as errors
# (--release in target/maturin: reuses the extension build's dependency build scripts, 27 s
# instead of 52 s cold on 2 cores; ~1 s when only lint config changed), rustfmt (rustfmt.toml), ruff's checks and format (pyproject.toml),
# and `typecheck`: mypy over python/pykvcache (pyproject.toml: strict for the package root, gate/ and vllm/; ~30 s of CPU
# cold, a few seconds with its .mypy_cache) and mypy's stubtest of the hand-written _core.pyi against the
# extension `develop` built (dev/stubtest-allowlist.txt: only what stubtest cannot judge). ruff and mypy: requirements-dev.
lint: lint-code typecheck

lint-code:
	CARGO_TARGET_DIR=target/maturin cargo clippy --release --all-targets --features python --quiet -- -D warnings
	cargo fmt --check
	$(PY) -m ruff check --quiet .
	$(PY) -m ruff format --check --quiet .

# The type gates (one core each).
typecheck:
	$(PY) -m mypy
	$(PY) -m mypy.stubtest pykvcache._core --allowlist dev/stubtest-allowlist.txt

test-rust:
	cargo test --release --locked

test-python: develop lmcache-env router-env
	$(PY) -m pytest -q -ra --durations=30

# Against vLLM 0.33 (CUDA build, no GPU needed): pykvcache's wheel installed
# into .venv-vllm033, every test that starts no engine process (spec, manager,
# connector scheduler side, the tiering tier, config, metrics, lookahead, gate,
# API conformance), and the build test (tests/engine/test_core_build.py: the wheel has no test
# hooks; PYKVCACHE_RELEASE_WHEEL=1 tells it so). Engine tests (marker `vllm`) need a GPU with this build.
# PYKVCACHE_SKIP_VLLM033=1 skips it, saying so (CI never sets it).
test-vllm033: wheel
	@if [ "$${PYKVCACHE_SKIP_VLLM033:-0}" = 1 ]; then \
	  echo "test-vllm033: SKIPPED (PYKVCACHE_SKIP_VLLM033=1): nothing ran against vLLM 0.33"; \
	else \
	  bash dev/setup_venv_vllm033.sh && \
	  $(VENV033)/bin/python -m pip install --disable-pip-version-check -q --no-deps --force-reinstall dist/pykvcache-*.whl && \
	  PYKVCACHE_RELEASE_WHEEL=1 $(VENV033)/bin/python -m pytest -q -ra --durations=10 -m "not vllm" tests/vllm tests/gate tests/engine/test_core_build.py; \
	fi

# The full suite CI runs, stage by stage (venv, build, lmcache, cargo, vllm033env, pytest,
# vllm033, benches: the benchmarks smoke-run once, tiny sizes, no timing so they cannot rot),
# each timed, with a per-stage summary at the end (dev/test_stages.sh).
test:
	bash dev/test_stages.sh

# The inner loop (< 3 min here once built): the engine's cargo tests and every test that
# starts no vLLM engine in tests/engine, tests/gate, tests/vllm and tests/docs.
QUICK_DIRS := tests/engine tests/gate tests/vllm tests/docs
test-quick: develop
	cargo test --release --locked
	$(PY) -m pytest -q -ra -m "not vllm" --durations=10 -n 2 --dist loadscope $(QUICK_DIRS)

demo: develop
	$(PY) -m pykvcache.tools.cli demo

bench: develop
	$(PY) -m pykvcache.tools.cli bench --out bench-out

# The serving benchmark: real vLLM OpenAI servers (docs/performance.md, "Serving"),
# both presets: sessions (every configuration, ~30-40 min on 2 cores) into
# bench-serve-out/sessions, then long-context (TTFT gain vs context length 1k-16k,
# quiet and read-capped, the crossover plot; hours on 2 cores, see decisions/0039)
# into bench-serve-out/long-context. bench-serve-long runs the second alone.
bench-serve: develop
	$(PY) -m pykvcache.tools.cli bench --parts serve --serve-preset sessions --out bench-serve-out/sessions
	$(PY) -m pykvcache.tools.cli bench --parts serve --serve-preset long-context --out bench-serve-out/long-context

bench-serve-long: develop
	$(PY) -m pykvcache.tools.cli bench --parts serve --serve-preset long-context --out bench-serve-out/long-context

clean:
	rm -rf target dist bench-out bench-serve-out demo-out gpu-bench-out
