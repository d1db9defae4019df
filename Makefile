# Two commands do the whole set-up on a fresh machine (Python 3.11 + pip):
#   make run    creates .venv on first use, then runs the default experiment
#   make test   creates .venv on first use, then lint + type check + the docs site build + the test suite (what CI runs)
#   make test-fast  the fast tier while editing: the cheapest tests within tests/tiers.py's budget
#   make docs   serves the documentation site (MkDocs + Material) at http://127.0.0.1:8000, rebuilding on edits
PYTHON ?= python3
# The suite in 2 pytest-xdist workers, a test file per worker at a time (files share fixtures): much
# of its time is waiting (signals, timeouts, process start-up), so 2 workers on 2 cores overlap it.
# Files go out longest first as last recorded (tests/tiers.py), not xdist's most-tests-first.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast durations lint typecheck docs docs-build pytest constraints clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m ddpexp $(ARGS)

test: lint typecheck docs-build pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The site from mkdocs.yml and docs/, served locally; --strict turns every warning (a broken link or
# anchor, a page missing from the nav) into a failure, so CI (make test) catches them.
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

docs-build: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

pytest: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m fast $(PYTEST_ARGS)

# The whole suite, each test's seconds merged into the record the fast tier is chosen from.
durations: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) --record-durations tests/durations.json

constraints: $(STAMP)
	{ head -2 constraints.txt; $(PY) -m pip freeze --exclude-editable | sort -f; } > constraints.new && mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) outputs multirun runs site .pytest_cache .mypy_cache .ruff_cache
