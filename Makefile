# Two commands do all set-up on a fresh machine:
#   make demo   -> creates .venv, installs kgp, runs `kgp demo`
#   make test   -> creates .venv, installs kgp with test extras, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned here (not in the package, which asks for torch>=2.4) because this pin installs a
# CPU wheel from local disk in seconds, while an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test test-fast lint bench-backend install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/kgp demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -ra -q

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -ra -q -m "not slow"

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench-backend: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_backend.py
