"""Spark integration tests: the stream app and its pipeline in local mode."""
