# Two entry points: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test clean-venv bench-alloc

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
# fixtures and compiled programs are built once.
test: $(VENV)/.installed-dev
	$(PY) -m pytest -n 2 --dist loadfile

bench-alloc: $(VENV)/.installed-dev
	$(PY) benchmarks/allocator_step.py

clean-venv:
	rm -rf $(VENV)
