# Two commands do all set-up on a fresh machine:
#   make demo   -> creates .venv, installs kgp, runs `kgp demo`
#   make test   -> creates .venv, installs kgp with test extras, runs the whole test suite
#   make test-numerics -> the numerical tests again under another BLAS code path / thread count (CI runs both)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned here (not in the package, which asks for torch>=2.4) because this pin installs a
# CPU wheel from local disk in seconds, while an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
export OMP_WAIT_POLICY ?= PASSIVE

# The numerical part of the suite: kernel operators, linear algebra, exact oracles, FALKON, EigenPro, DSG,
# BLESS, predictive variance, learning, float32, distributed fits and the fingerprints. CI runs it a
# second time under NUMERIC_ENV, another MKL code path and thread count than the default run's, so that
# a tolerance that holds only for one CPU's rounding fails here rather than on a user's host (a CG
# iteration count and an ill-conditioned oracle can move between an AVX2 and an AVX-512 host).
NUMERIC_TESTS ?= tests/test_operator.py tests/test_operator_linop.py tests/test_linalg.py \
	tests/test_exact_oracles.py tests/test_exact_memory.py tests/test_falkon.py tests/test_eigenpro.py \
	tests/test_dsg.py tests/test_bless.py tests/test_gp_predict.py tests/test_learning.py \
	tests/test_learning_bounds.py tests/test_learning_defaults.py tests/test_learning_refit.py \
	tests/test_objectives.py tests/test_objective_holdout.py tests/test_float32.py tests/test_interop.py \
	tests/test_fingerprints.py tests/test_distributed.py tests/test_distributed_eigenpro.py \
	tests/test_linalg_blocked.py tests/test_variance_rows.py tests/test_matern12_near_zero.py \
	tests/test_falkon_mixed.py tests/test_fused_cpu.py tests/test_direct_lapack.py
# MKL's conditional-numerical-reproducibility path for every CPU (no AVX2 / AVX-512 kernels), one thread
NUMERIC_ENV ?= MKL_CBWR=COMPATIBLE MKL_NUM_THREADS=1 OMP_NUM_THREADS=1
NUMERIC_EXCLUDE ?=
NUMERIC_PYTEST_ARGS ?=

.PHONY: demo test test-fast test-numerics lint bench-backend install

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

test-numerics: $(VENV)/.installed
	env $(NUMERIC_ENV) $(BIN)/python -m pytest -ra -q $(NUMERIC_PYTEST_ARGS) $(filter-out $(NUMERIC_EXCLUDE),$(NUMERIC_TESTS))

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -ra -q -m "not slow"

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench-backend: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_backend.py
