# Every target uses the project's own virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := swarm dht averaging trainer

.PHONY: setup test lint check clean

# torch==2.13.0 first: it resolves to the local CPU build. An unpinned torch
# would pull gigabytes of CUDA packages.
setup:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'

test:
	$(BIN)/python -m pytest

lint:
	$(BIN)/ruff check $(PACKAGES) tests benchmarks examples
	$(BIN)/mypy

check: lint test

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
