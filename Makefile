# `make test` builds .venv on first use, installs everything, runs the suite.
# torch is installed first, pinned, so nothing later pulls a different build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test install clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
