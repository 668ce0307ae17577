# Two entry points: `make train` (set up, then train the default model) and `make test` (set up, then run the
# tests). The environment is built once; re-runs only redo it when pyproject.toml or the set-up script change.
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
CONFIG ?= configs/dlrm_lookahead.yaml
LOGDIR ?= logs
PYTEST_ARGS ?=
# The fast tier's per-test bound (tests/conftest.py): 10 s where the fast tier runs alone; the whole run allows
# twice that, so that a slower machine (the 2-core AMD EPYC takes about 1.6x this Intel one) does not fail a test
# the fast tier's own bound admits here.
FULL_RUN_FAST_LIMIT_S ?= 20
# pytest-xdist workers: the modules that launch several processes run one after another on one worker, the
# single-process modules on the others beside them (tests/conftest.py); 0 runs everything in this process.
TEST_WORKERS ?= 2
# The tests start about 250 interpreters; each imports the package. With PYTHONDONTWRITEBYTECODE set (some
# images set it), each would compile every module from source again (0.15 s of CPU a process): compile once.
COMPILE = $(PYTHON) -m compileall -q torchrec_lookahead tests benchmarks examples > /dev/null

.PHONY: setup train test test-fast lint typecheck configs bench clean

$(VENV)/.ready: pyproject.toml scripts/setup_env.sh
	PYTHON=$(PY) VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

setup: $(VENV)/.ready

train: setup
	$(PYTHON) -m torchrec_lookahead fit --config $(CONFIG) --trainer.default_root_dir $(LOGDIR)

test: setup
	$(PYTHON) -m ruff check torchrec_lookahead tests benchmarks examples
	$(PYTHON) -m ruff format --check torchrec_lookahead tests benchmarks examples
	$(PYTHON) -m mypy
	$(COMPILE)
	TRL_FAST_LIMIT_S=$(FULL_RUN_FAST_LIMIT_S) $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(COMPILE)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not distributed" $(PYTEST_ARGS)

lint: setup
	$(PYTHON) -m ruff check torchrec_lookahead tests benchmarks examples
	$(PYTHON) -m ruff format torchrec_lookahead tests benchmarks examples

typecheck: setup
	$(PYTHON) -m mypy

bench: setup
	$(PYTHON) benchmarks/baseline.py --quick

clean:
	rm -rf $(VENV) logs lightning_logs .pytest_cache .ruff_cache .mypy_cache
