# The two set-up commands of the README: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# ../shared/traces is where the public Mooncake traces live next to a checkout; the
# package also bundles the conversation trace, so `pymooncake trace stats` works without it.

.PHONY: demo test install lint clean system-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[engine,api,dev]'

# Real etcd for the etcd metadata backend's tests (Debian's etcd-server). Best effort: the
# etcd tests skip with a reason when it cannot be installed.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) || echo "note: etcd-server could not be installed; etcd tests will skip"; }

demo: install
	$(BIN)/pymooncake trace stats

lint: install
	$(BIN)/ruff check src tests

test: install system-deps
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
