# ascendbind — developer entry points. Everything runs from a local .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test test-stress run lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

# Each test file FILES names (default: all) must pass RUNS consecutive runs while
# BURNERS busy-looping processes keep the CPUs busy:  make test-stress FILES=tests/test_daemon_api.py
FILES   ?= $(wildcard tests/test_*.py)
RUNS    ?= 30
BURNERS ?= 2
test-stress: install
	$(BIN)/python tests/stress.py --runs $(RUNS) --burners $(BURNERS) $(FILES)

run: install
	$(BIN)/python -m ascendbind.daemon.demo

lint: install
	$(BIN)/python -m compileall -q ascendbind tests bench
	$(BIN)/python -m pip install -q pyflakes
	$(BIN)/python -m pyflakes ascendbind tests bench

# Runs every bench (a few minutes), then writes docs/benchmarks.md and docs/bench/*.png.
# matplotlib is a bench-only extra: installed here, never needed by the daemon or the tests.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	@command -v stress-ng >/dev/null 2>&1 || echo "make bench: stress-ng not found (apt-get install stress-ng); the noisy neighbour will be our own spinning processes"
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
