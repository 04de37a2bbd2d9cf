# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.demo: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/overlord demo

test: $(VENV)/.dev
	$(BIN)/ruff check overlord tests benchmarks examples
	$(BIN)/mypy overlord
	tools/loopback $(BIN)/pytest -q

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/planner.py
	$(BIN)/python benchmarks/balance.py
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) overlord-demo .pytest_cache .mypy_cache .ruff_cache
