# Two commands do everything on a fresh machine (Python 3.11, no GPU):
#   make local   set up .venv, then run the 27B recipe's --local job on local Ray on CPU
#   make test    set up .venv, then run the test suite (all of it)
#   make test-fast  the unit-level tests only (pytest -m "not slow": no Ray, no server, no training run)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup local test test-fast bench-data clean
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first: an unpinned torch pulls a several-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

local: setup
	$(BIN)/python jobs/qwen27b_b300.py --local

test: setup
	$(BIN)/python -m pytest -x -q --durations=25 tests

test-fast: setup
	$(BIN)/python -m pytest -x -q -m "not slow" tests

bench-data: setup
	$(BIN)/python bench/data_pipeline.py

clean:
	rm -rf $(VENV) runs .pytest_cache
