# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test docs lint bench clean

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
	$(BIN)/ruff check overlord tests benchmarks examples docs conftest.py
	$(BIN)/mypy overlord
	tools/loopback $(BIN)/pytest -q

# the documentation site, into site/ (a broken link or a page missing from nav fails it)
docs: $(VENV)/.dev
	$(BIN)/mkdocs build --strict

# MosaicML Streaming, for benchmarks/throughput_vs.py only. Its declared requirements
# (numpy<2.2, transformers<5, torchvision, cloud SDKs) would replace this project's CPU
# torch and numpy, so it goes in without them, with the few modules it imports.
$(VENV)/.bench: $(VENV)/.dev
	$(BIN)/pip install --quiet --no-deps mosaicml-streaming==0.13.0
	$(BIN)/pip install --quiet --no-deps "xxhash<4" zstd catalogue Brotli python-snappy cramjam
	$(BIN)/pip install --quiet transformers==5.24.0
	touch $@

bench: $(VENV)/.bench
	$(BIN)/python -m benchmarks.planner
	$(BIN)/python -m benchmarks.balance
	$(BIN)/python -m benchmarks.throughput
	$(BIN)/python -m benchmarks.pretokenized
	$(BIN)/python -m benchmarks.step_cost
	$(BIN)/python -m benchmarks.balance_e2e
	$(BIN)/python -m benchmarks.planner_scale
	$(BIN)/python -m benchmarks.mesh
	tools/loopback $(BIN)/python -m benchmarks.ray_overhead
	tools/loopback $(BIN)/python -m benchmarks.memory
	tools/loopback $(BIN)/python -m benchmarks.throughput_vs
	$(BIN)/python -m benchmarks.bpe

clean:
	rm -rf $(VENV) overlord-demo site .pytest_cache .mypy_cache .ruff_cache
