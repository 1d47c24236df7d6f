# `make test` and `make demo` build the virtualenv from scratch when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here (CPU wheel); pyproject.toml states a range for users.
TORCH_PIN := torch==2.13.0
# the demo's few packages first (torch, streamds, tokenizers), then every extra for the tests
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint demo bench docs clean

setup: $(STAMP)

$(DEMO_STAMP): pyproject.toml
	@echo "== setting up $(VENV) for the demo: torch (CPU build), streamds, tokenizers"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --progress-bar on $(TORCH_PIN)
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -e ".[example]"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@echo "== adding every extra to $(VENV) for the tests, the docs and the benchmarks"
	$(BIN)/pip install --disable-pip-version-check --quiet -e ".[dev,remote,tar,bench,example,cluster,frameworks,docs]"
	touch $(STAMP)

# the suite without the real frameworks under torchrun (marked slow: tens of seconds each),
# which test-slow runs; CI runs both
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py --write-docs

# the docs site into site/; --strict fails on a broken link or a docstring it cannot render
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
