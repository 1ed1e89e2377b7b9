# cardiofl: `make demo` runs the main job, `make test` installs everything and runs the suite.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel is enough for tests; on a GPU machine install the CUDA build of torch first.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install test test-fast lint soak demo clean containers containers-production plugin-example docs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e '.[dev]'
	touch $@

# Two workers, each taking whole test files (module fixtures are built once); TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -o console_output_style=count

# The fast tier: no processes, no PostgreSQL, no browser (tests/conftest.py marks them); CONTRIBUTING.md "The suite".
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -o console_output_style=count \
		-m "not slow and not postgres and not processes and not browser"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# A coordinator and 4 echo agents through a study of SOAK_ROUNDS rounds of the tiny model (bench/soak.py):
# fails when the coordinator's RSS grows 1 MB or more per 100 rounds after the warm-up, when its open
# descriptors or database handles grow, or when the database or blob directory outgrow the retention rule.
# Then one trained round of a BIG_MODEL_MB MB theta^g with 3 site agents, plain and then secure (bench/big_round.py):
# each fails when the coordinator's peak RSS exceeds 3 x theta^g, or an agent's 4 x theta^g, above what each held
# before the study (at 1 GB: 2.36 and 2.69 for the coordinator, 3.12-3.13 for the agents; docs/researcher/benchmarks.md).
# BIG_MODEL_MB=0 leaves both out. Alone, not beside the suite's workers: at 1024 they take about 6 minutes on 2 cores
# and hold up to 12 GB together.
SOAK_ROUNDS ?= 300
SOAK_MAX_SLOPE_MB ?= 1.0
BIG_MODEL_MB ?= 1024
soak: install
	$(PY) bench/soak.py --rounds $(SOAK_ROUNDS) --max-slope-mb $(SOAK_MAX_SLOPE_MB)
ifneq ($(BIG_MODEL_MB),0)
	$(PY) bench/big_round.py --modes plain,secure --megabytes $(BIG_MODEL_MB)
endif

# A coordinator and 4 site agents as processes on 127.0.0.1, one FedDualAtt study end to end.
demo: install
	$(VENV)/bin/cardiofl demo $(DEMO_ARGS)

# The images built with no network inside the builds (deploy/build-images.sh: a Debian base image,
# a local wheelhouse) and run for real: a coordinator and two agents as read-only, non-root
# containers finish a tiny study. Needs Docker, and root for the base image; `.ci/run` runs it.
containers:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) deploy/build-images.sh
	$(PYTHON) tests/containers/run_study.py

# The production compose files run for real (deploy/compose.coordinator.yaml, deploy/compose.site.yaml):
# PostgreSQL (cardiofl/postgres), the coordinator and two agents finish one tiny study, secrets as files.
containers-production:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) $(PYTHON) tests/containers/run_production.py

# The example plug-in (examples/plugin-example) in a venv of its own beside the project: cardiofl and
# the example installed as wheels, the example's tests run against them, then one study of its model
# and algorithm through a coordinator and two agents as processes and through the runner, compared
# bit for bit. `.ci/run` runs it.
PLUGIN_VENV ?= .venv-plugin
plugin-example:
	rm -rf $(PLUGIN_VENV)
	$(PYTHON) -m venv $(PLUGIN_VENV)
	$(PLUGIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(PLUGIN_VENV)/bin/python -m pip install -q "$(TORCH)" . pytest
	$(PLUGIN_VENV)/bin/python -m pip wheel -q --no-deps -w $(PLUGIN_VENV)/wheels examples/plugin-example
	$(PLUGIN_VENV)/bin/python -m pip install -q --no-deps $(PLUGIN_VENV)/wheels/cardiofl_plugin_example-*.whl
	cp -r examples/plugin-example/tests examples/plugin-example/check_study.py $(PLUGIN_VENV)/
	cd $(PLUGIN_VENV) && bin/python -m pytest -q -p no:cacheprovider tests
	cd $(PLUGIN_VENV) && bin/cardiofl plugins list
	cd $(PLUGIN_VENV) && bin/python check_study.py --workdir study

# The documentation site in site/ (offline: no web fonts or CDN scripts); --strict fails on a broken link or a
# missing page. The reference pages (CLI, REST, configuration, study terms, error codes) are generated while it
# builds (docs/hooks.py). Open site/index.html.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) $(PLUGIN_VENV) .pytest_cache .ruff_cache .import_linter_cache .hypothesis .cardiofl .wheelhouse
