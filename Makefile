# Every target uses the project's own virtual environment in .venv, and builds
# it first when it is missing or older than pyproject.toml (the stamp file), so
# `make run` and `make test` work on a fresh clone and a second call does not
# reinstall anything.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := swarm dht averaging trainer

.PHONY: setup run test test-fast test-gpu lint check clean

# torch==2.13.0 first: it resolves to the local CPU build. An unpinned torch
# would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The main job: a demo swarm of local peers training together on 127.0.0.1.
run: $(STAMP)
	$(BIN)/swarm demo

test: $(STAMP)
	$(BIN)/python -m pytest --durations=25

# The inner loop: everything but the tests marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

# Needs an NVIDIA GPU and a CUDA build of torch; `make test` does not collect tests/gpu.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check $(PACKAGES) tests benchmarks examples
	$(BIN)/mypy

check: lint test

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
