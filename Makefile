# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test test-gpu clean-venv bench-alloc

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[serve]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev,serve,bench,tunix]'
	# Tunix without its pins (its safetensors<0.8 would downgrade transformers); the extra
	# above holds the packages its modules import.
	$(PY) -m pip install --no-deps google-tunix==0.1.7
	touch $(VENV)/.installed-base $@

run: $(VENV)/.installed-base
	$(PY) -m jpaged.main $(ARGS)

# Two workers (the CI machine has 2 cores); a test file stays on one worker, so its module
# fixtures and compiled programs are built once. The 15 slowest tests are listed at the end.
test: $(VENV)/.installed-dev
	$(PY) -m pytest -n 2 --dist loadfile --durations=15

# The GPU suite: every GPU-marked test and the engine tests marked to run there too, compiled
# on a CUDA GPU, with the machine's own Python (a GPU machine brings its jax[cuda]; no venv).
# Engines in these tests start with warm-up off, so the suite runs in minutes. Refuses to run
# where JAX sees no GPU (every test would skip and the run would look green).
# Only the files that hold such tests are collected: a GPU machine need not have the server's
# packages (fastapi) that other test files import. Workers share the GPU, each allocating as it
# needs (not JAX's default 75% up front): compiling the kernels is the suite's cost, and it runs
# on the host's cores. Four on a card of 120 GB or more; three on smaller ones. Tests marked
# with an xdist_group run on one worker, one after another (references too large to share
# the card: tests/test_prefill_mgpu.py).
# GPU_PYTEST_ARGS adds pytest options (e.g. -v).
GPU_PYTHON ?= python3
GPU_TEST_FILES = $(shell grep -lE 'mark\.gpu' tests/test_*.py)
GPU_MEMORY_MIB = $(shell nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
	2>/dev/null | head -1)
GPU_WORKERS ?= $(shell [ "$(GPU_MEMORY_MIB)" -lt 120000 ] 2>/dev/null && echo 3 || echo 4)
GPU_PYTEST_ARGS ?=
test-gpu:
	@$(GPU_PYTHON) -c "import jax, sys; sys.exit(None if jax.default_backend() == 'gpu' else \
		'make test-gpu: JAX sees no GPU here (backend: ' + jax.default_backend() + ')')"
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(GPU_PYTHON) -m pytest -m "gpu or gpu_suite" \
		-o addopts="" -q -rfEs -p no:cacheprovider -n $(GPU_WORKERS) --dist loadgroup \
		--durations=15 $(GPU_PYTEST_ARGS) $(GPU_TEST_FILES)

bench-alloc: $(VENV)/.installed-dev
	$(PY) benchmarks/allocator_step.py

clean-venv:
	rm -rf $(VENV)
