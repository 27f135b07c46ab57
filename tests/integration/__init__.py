"""Integration tests: a real Postgres (one cluster per session), local Spark, HTTP servers in-process."""
