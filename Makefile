# The two entry points: `make demo` and `make test`. Both set up .venv themselves.
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_CPU_OMP_THREADS_BIND := nobind

.PHONY: venv develop wheel test test-rust test-python demo bench bench-serve clean

venv:
	bash tools/setup_venv.sh

# Builds the Rust extension (release) into the venv.
develop: venv
	rm -f python/pykvcache/_core.cpython-*.so  # pre-abi3 builds would shadow the new one
	$(VENV)/bin/maturin develop --release --quiet

# One abi3 wheel (CPython >= 3.11, manylinux) in dist/.
wheel: venv
	$(VENV)/bin/maturin build --release --quiet --out dist

test-rust:
	cargo test --release --locked

test-python: develop
	$(PY) -m pytest -q -ra

# Benchmarks are smoke-run once (tiny sizes, no timing) so they cannot rot.
test: test-rust test-python
	if [ -d benches ]; then $(PY) -m pytest -q benches --benchmark-disable; fi

demo: develop
	$(PY) -m pykvcache.cli demo

bench: develop
	$(PY) -m pykvcache.cli bench --out bench-out

# The serving benchmark: real vLLM OpenAI servers, every configuration (~30-40 min on 2 cores).
bench-serve: develop
	$(PY) -m pykvcache.cli bench --parts serve --out bench-serve-out

clean:
	rm -rf target dist bench-out bench-serve-out demo-out gpu-bench-out
