# Everything a fresh machine needs, from the project's own files. `make demo` runs the main job on an
# embedded default; `make test` runs the checks and the test suite. Both build .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch. A plain `torch` requirement would pull several GB of CUDA wheels.
TORCH := torch==2.13.0

.PHONY: all venv system demo test check fmt crds bench clean

all: test

# Debian packages the tests and benchmarks use: nginx serves ranges over loopback, libsodium lets the real
# tensorizer package (an interop peer) encrypt and decrypt.
system:
	@missing=""; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	ldconfig -p 2>/dev/null | grep -q libsodium.so.23 || missing="$$missing libsodium23"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else \
			echo "missing Debian packages:$$missing (apt-get install$$missing)" >&2; exit 1; \
		fi; \
	fi

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,torch]'
	@touch $(STAMP)

venv: system $(STAMP)

demo: venv
	$(BIN)/python benchmarks/demo.py

check: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	PYTHONPATH=loader:sidecar:operator $(BIN)/lint-imports
	$(BIN)/python -m modelload.operator.crd --check

fmt: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

crds: venv
	$(BIN)/python -m modelload.operator.crd --write

test: check
	MODELLOAD_REQUIRE_SERVERS=1 $(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/memory_modes.py
	$(BIN)/python benchmarks/peer_fleet.py --out docs/peer-fleet.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
