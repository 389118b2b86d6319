# `make test` builds .venv on first use, installs everything, runs the suite.
# `make demo` does the same install, then trains a tiny LLaMA on 4 CPU processes
# (tp 2 x pp 2, torchrun, gloo) and writes out/demo/{timeline.png,loss.png,metrics.json}.
# torch is installed first, pinned, so nothing later pulls a different build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

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

DEMO_PLAN ?= plans/llama-tp2-pp2.yaml
DEMO_ARGS ?= --model tiny-llama --steps 30 --out out/demo

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node 4 -m rewrite train $(DEMO_PLAN) $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
