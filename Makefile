# Two commands do everything on a fresh machine (Python 3.11, no GPU):
#   make local   set up .venv, then run the 27B recipe's --local job on local Ray on CPU
#   make test    set up .venv, then run the test suite (all of it)
#   make test-fast  the unit-level tests only (pytest -m "not slow": no Ray, no server, no training run, no fresh Python)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# PyPI's Linux torch is the CUDA build, which pulls several GB of nvidia-* wheels a CPU run never loads.
# Without an NVIDIA driver (no nvidia-smi) the CPU build comes from PyTorch's CPU wheel index; when that
# index cannot be reached within a few seconds, the default index serves torch instead.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)

.PHONY: setup local test test-fast bench-data clean
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
ifeq ($(HAS_NVIDIA),yes)
	$(BIN)/pip install -q $(TORCH)
else
	$(BIN)/pip install -q --timeout 5 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH) || \
	  { echo "$(TORCH_CPU_INDEX) not reachable: torch from the default index"; $(BIN)/pip install -q $(TORCH); }
endif
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
