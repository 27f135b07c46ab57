"""Unit tests: no Postgres, no Spark, no network server; `make test-fast` runs this tier alone."""
