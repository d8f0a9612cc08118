# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest workers (pytest-xdist): the suite's builds are single-threaded LLVM runs
JOBS ?= 2

.PHONY: demo test gpu-check gpu-bundle bench train-bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m redfuser derive --all
	$(PY) -m redfuser kernels

test: $(STAMP)
	$(VENV)/bin/ruff check redfuser algebra tests
	$(PY) -m pytest -n $(JOBS) --durations=25

gpu-check: $(STAMP)
	$(PY) -m redfuser.tools.gpucheck

# TVM packed for a GPU machine without network (run there: redfuser/tools/gpu_run.sh)
gpu-bundle: $(STAMP)
	bash redfuser/tools/gpu_bundle.sh

bench: $(STAMP)
	$(PY) -m redfuser.tools.bench

# forward + backward of redfuser ops against torch, time and peak memory (docs/training.md)
train-bench: $(STAMP)
	$(PY) -m redfuser.tools.train_bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
