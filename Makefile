# Two entry points for a fresh clone:  make up  (run everything)  and  make test  (run every test).
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: up test bench browser-deps clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]' -e ./client
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/herald up

# Headless Chromium for the browser test (Debian package; skipped where apt is unavailable).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || ( command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) ) || \
	  echo "note: chromium not installed; the browser test will be skipped"

test: $(STAMP) browser-deps
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/python -m bench

clean:
	rm -rf $(VENV) var
