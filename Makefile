# ascendbind — developer entry points. Everything runs from a local .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test run lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

run: install
	$(BIN)/python -m ascendbind.daemon.demo

lint: install
	$(BIN)/python -m compileall -q ascendbind tests bench
	$(BIN)/python -m pip install -q pyflakes
	$(BIN)/python -m pyflakes ascendbind tests bench

bench: install
	$(BIN)/python bench/plan.py
	$(BIN)/python bench/bind.py
	$(BIN)/python bench/daemon_idle.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
