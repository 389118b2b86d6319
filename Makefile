# `make test` builds .venv on first use, installs everything, runs the suite.
# `make demo` does the same install, then trains a tiny LLaMA on 4 CPU processes
# (tp 2 x pp 2, `rewrite train --nproc-per-node 4`, gloo) and writes out/demo/{timeline.png,loss.png,metrics.json}.
# torch is installed first, pinned, so nothing later pulls a different build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

install: $(STAMP)

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "rewrite needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) --version 2>&1): make PYTHON=python3.11 ..."; exit 1; }
	@echo "==> creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	@echo "==> [1/3] upgrading pip in $(VENV)"
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "==> [2/3] installing $(TORCH_SPEC) first, so nothing later pulls another build (a minute or so)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	@echo "==> [3/3] installing rewrite (editable), transformers and the rest of its dependencies, and the test tools"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)
	@echo "==> installed: $(BIN)/rewrite --help, make demo, make test"

# Two pytest workers: the end-to-end launches (tests/distributed/run) in two units started first, every
# other test file on whichever worker is free (tests/conftest.py). TEST_ARGS= runs it in one process.
TEST_ARGS ?= -n 2

test: $(STAMP)
	$(BIN)/python -m pytest $(TEST_ARGS)

DEMO_PLAN ?= plans/llama-tp2-pp2.yaml
DEMO_ARGS ?= --model tiny-llama --steps 30 --out out/demo

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/rewrite train $(DEMO_PLAN) --nproc-per-node 4 $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
