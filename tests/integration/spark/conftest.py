"""Fixtures of the Spark integration tests."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """Spark in local mode, as the stream app runs it."""
    from sequin_provider.spark.app import spark_session

    session = spark_session("sequin-spark-tests", "local[2]")
    yield session
    session.stop()
