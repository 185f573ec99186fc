# Quick start targets: `make run` (the main job) and `make test` (the whole suite).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install clean

$(BIN)/hwkv: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so the extras below do not pull a CUDA build
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e ".[cpu,test,bench]"
	touch $(BIN)/hwkv

install: $(BIN)/hwkv

run: install
	$(BIN)/hwkv bench

test: install
	$(BIN)/python -m pytest -q -x

clean:
	rm -rf $(VENV)
