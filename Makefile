# fltff quickstart. Two commands on a fresh machine with Python 3.11:
#   make quickstart   # set up .venv (once) and run gin_configs/quickstart.gin offline
#   make test         # set up .venv (once) and run the test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.fltff-installed
EDITABLE := $(VENV)/.fltff-editable
OUTPUT_DIR ?= runs/quickstart
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each owning one worker_binary: 3 on the CI machine's 2 cores,
# since part of a test's time is spent waiting (program starts, RPC deadlines, the C++ worker):
# 2 processes kept the cores busy 79 % of the suite's time, 3 processes 158 of 200 %; a fourth
# added no CPU use and made the suite slower (each process's work took longer).
# Tests are handed out one at a time, the long ones first; the tests of one expensive shared
# fixture (a finished run, an installed wheel) go to one process (tests/conftest.py).
PYTEST_WORKERS ?= 3
GPU_STAMP := $(VENV)/.fltff-gpu-installed
# Flags of `python -m pipelines.gpu_check`, e.g. GPU_CHECK_ARGS='--bench_rounds=2'.
GPU_CHECK_ARGS ?=

.PHONY: setup setup-gpu quickstart test bench gpu-check clean-venv
setup: $(EDITABLE)
setup-gpu: $(GPU_STAMP)

# TFF 0.87.0 pins jax/jaxlib 0.4.14, for which no Python 3.11 wheel exists. We install the
# rest of the pinned set (with jax/jaxlib 0.4.13) and then TFF itself with --no-deps.
# jax 0.4.13 is an sdist whose setup.py imports pkg_resources: build it without isolation
# against setuptools<70.
$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "fltff needs Python 3.11 (TFF 0.87 supports <=3.11); found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check "setuptools<70" wheel
	$(VPY) -m pip install -q --disable-pip-version-check --no-build-isolation $$(grep -E '^jax(lib)?==' requirements.txt)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps tensorflow-federated==0.87.0
	@# os._exit skips TFF's ServiceManager.__del__, which fails noisily at interpreter exit.
	$(VPY) -c 'import os, tensorflow_federated, tensorflow_datasets, gin; print("fltff environment ready", flush=True); os._exit(0)'
	@touch $(STAMP)

# fltff itself, editable (pyproject.toml): `import fltff` then works from any directory. No
# dependencies here: the stack above is the pinned one.
$(EDITABLE): $(STAMP) pyproject.toml
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(EDITABLE)

# The GPU build: the tensorflow 2.14.1 wheel above already is one; this adds the CUDA 11.8 and
# cuDNN 8.7 libraries it was built against, as pip wheels (requirements-gpu.txt: the pins of
# TF's own `and-cuda` extra but TensorRT, about 2 GB). The constraints keep the pinned stack.
$(GPU_STAMP): $(EDITABLE) requirements-gpu.txt
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-gpu.txt -c requirements.txt
	@touch $(GPU_STAMP)

quickstart: setup
	$(VENV)/bin/fltff run --gin_file=gin_configs/quickstart.gin --output_dir=$(OUTPUT_DIR)

test: setup
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) tests

bench: setup
	$(VPY) -m pipelines.bench

# On a GPU machine: the device TensorFlow sees, the tests marked gpu, and vectorised FedAvg
# rounds on the GPU against this machine's CPU (pipelines/gpu_check.py).
gpu-check: setup-gpu
	$(VPY) -m pipelines.gpu_check $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
