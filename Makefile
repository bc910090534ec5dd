# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow install clean browser screenshots

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/mtpspec demo

# The browser test drives Debian's chromium headless (never a downloaded browser): install it when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
browser:
	@command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| echo "warning: could not install chromium; tests/test_browser.py will skip"

test: $(STAMP) browser
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

ASSETS ?= $(or $(MTPSPEC_ASSETS),../shared/assets)

# The README's pictures, made by the project itself: a trace of real runs and the live verify page.
screenshots: $(STAMP) browser
	$(BIN)/mtpspec trace "Once upon a time, there was a little girl named Lily. She loved to" --model $(ASSETS)/models/stories260K.bin \
		--drafters draft,ngram --draft-model $(ASSETS)/models/stories260K_q80.bin --ks 1,2,4 \
		--max-new-tokens 40 --repeat 5 --out build/trace.html --png docs/images/trace.png
	MTPSPEC_SCREENSHOT_DIR=docs/images $(BIN)/pytest -q tests/test_browser.py

clean:
	rm -rf $(VENV) .pytest_cache
