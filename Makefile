# Two commands matter: `make run` and `make test`. Both create .venv with pip when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench lint docs clean install install-dev

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The stamp files make a second install a no-op until pyproject.toml changes.
$(VENV)/.stamp-install: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.stamp-install

install: $(VENV)/.stamp-install
install-dev: $(VENV)/.stamp-dev

# The whole workflow, locally, on the bundled digits data: stage -> train (2 processes) -> export -> evaluate.
run: install
	$(BIN)/pyflyte run workflows/pipeline.py training_pipeline

test: install-dev
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/loader.py
	$(BIN)/python bench/checkpoint.py

lint: install-dev
	$(BIN)/ruff check traincore tasks workflows tests bench

# The README's config table, generated from the field docstrings in traincore/config.py.
docs: install
	$(BIN)/python -m traincore.config_doc --write README.md

clean:
	rm -rf runs .pytest_cache
