# Two entry points for a fresh clone:  make up  (run everything)  and  make test  (run every test).
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: up test bench bench-deps browser-deps clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]' -e ./client
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/herald up

# Headless Chromium for the browser test: Debian's package, which Playwright drives (it
# downloads no browser). Where apt-get is missing or not allowed the test skips, except
# under CI, where it fails. No stdin in CI: apt must never ask; a busy dpkg lock is waited
# for; stale package lists (a .deb gone from the mirror) are refreshed and tried again.
APT_GET  := DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300
APT_LOG  := /tmp/herald-browser-deps.log

browser-deps:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  { $(APT_GET) install chromium >$(APT_LOG) 2>&1 || \
	    { $(APT_GET) update >>$(APT_LOG) 2>&1 && $(APT_GET) install chromium >>$(APT_LOG) 2>&1; }; } && \
	  echo "chromium installed (apt-get)"; } || \
	  { echo "note: chromium not installed (see $(APT_LOG)); the browser test will be skipped"; tail -n 5 $(APT_LOG) 2>/dev/null || true; }

# Bytecode first: the tests start hundreds of Herald processes, and where the environment
# sets PYTHONDONTWRITEBYTECODE (as these machines do) each would compile Herald's modules
# again (tests/test_streams.py alone: 86 → 64 s of CPU).
test: $(STAMP) browser-deps
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m compileall -q -j 0 launcher herald gateway workers notifier schemas client/herald_client bench examples tests >/dev/null
	$(VENV)/bin/pytest

# Benchmarks (bench/, results in bench/out/): the bench extra (matplotlib for the chart, Celery
# and arq), and Debian's wrk, nginx + nchan and redis-server for the HTTP load, the push
# baselines and the peers, installed like chromium above. Without them the bench still runs: a
# Python load client replaces wrk, the nchan baselines and the peers are reported unavailable.
# `make bench PEERS=1` adds Celery + Redis and arq to the end-to-end scenario (--peers);
# BENCH_ARGS passes anything else (`make bench BENCH_ARGS="--only e2e" PEERS=1`).
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_LOG   := /tmp/herald-bench-deps.log
NCHAN_SO    := /usr/lib/nginx/modules/ngx_nchan_module.so

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(VENV)/bin/pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench-deps:
	@{ command -v wrk >/dev/null 2>&1 && command -v nginx >/dev/null 2>&1 && test -e $(NCHAN_SO) && \
	   command -v redis-server >/dev/null 2>&1; } || \
	  { command -v apt-get >/dev/null 2>&1 && \
	  { $(APT_GET) install wrk nginx libnginx-mod-nchan redis-server >$(BENCH_LOG) 2>&1 || \
	    { $(APT_GET) update >>$(BENCH_LOG) 2>&1 && \
	      $(APT_GET) install wrk nginx libnginx-mod-nchan redis-server >>$(BENCH_LOG) 2>&1; }; } && \
	  echo "wrk, nginx, nchan and redis-server installed (apt-get)"; } || \
	  { echo "note: wrk/nginx/nchan/redis-server not installed (see $(BENCH_LOG)); the bench falls back or reports baselines unavailable"; \
	    tail -n 5 $(BENCH_LOG) 2>/dev/null || true; }

PEERS      ?=
BENCH_ARGS ?=

bench: $(BENCH_STAMP) bench-deps
	$(VENV)/bin/python -m bench $(if $(PEERS),--peers) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) var
