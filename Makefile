# Two entry points: `make train` (set up, then train the default model) and `make test` (set up, then run the
# tests). The environment is built once; re-runs only redo it when pyproject.toml or the set-up script change.
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
CONFIG ?= configs/dlrm_lookahead.yaml
LOGDIR ?= logs
PYTEST_ARGS ?=

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
	$(PYTHON) -m pytest -q --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow and not distributed" $(PYTEST_ARGS)

lint: setup
	$(PYTHON) -m ruff check torchrec_lookahead tests benchmarks examples
	$(PYTHON) -m ruff format torchrec_lookahead tests benchmarks examples

typecheck: setup
	$(PYTHON) -m mypy

bench: setup
	$(PYTHON) benchmarks/baseline.py --quick

clean:
	rm -rf $(VENV) logs lightning_logs .pytest_cache .ruff_cache .mypy_cache
