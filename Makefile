# make demo: set up .venv and run the pipeline end to end on an embedded Postgres.
# make test: the test suite (real Postgres, real Spark in local mode).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYSPARK_PYTHON := $(CURDIR)/$(PY)
export PYSPARK_DRIVER_PYTHON := $(CURDIR)/$(PY)

.PHONY: venv demo up test bench clean lock

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@command -v java >/dev/null || { echo "Java 17+ is required for Spark (apt-get install openjdk-17-jre-headless)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sequin_provider.demo

# Embedded Postgres + airflow standalone with this provider and dags/, at http://localhost:8080.
up: $(STAMP)
	$(PY) -m sequin_provider.up

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/stream_throughput.py
	$(PY) bench/backfill_throughput.py
	$(PY) bench/delivery_throughput.py

# Refresh requirements.lock from the current venv (after changing pyproject.toml pins).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^sequin-provider' > requirements.lock

clean:
	rm -rf var spark-warehouse metastore_db
