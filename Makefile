# cardiofl: `make demo` runs the main job, `make test` installs everything and runs the suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel is enough for tests; on a GPU machine install the CUDA build of torch first.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install test lint demo clean containers

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e '.[dev]'
	touch $@

# Two workers, each taking whole test files (module fixtures are built once); TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# A coordinator and 4 site agents as processes on 127.0.0.1, one FedDualAtt study end to end.
demo: install
	$(VENV)/bin/cardiofl demo $(DEMO_ARGS)

# The images built with no network inside the builds (deploy/build-images.sh: a Debian base image,
# a local wheelhouse) and run for real: a coordinator and two agents as read-only, non-root
# containers finish a tiny study. Needs Docker, and root for the base image; `.ci/run` runs it.
containers:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) deploy/build-images.sh
	$(PYTHON) tests/containers/run_study.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .import_linter_cache .hypothesis .cardiofl .wheelhouse
