"""The stream app's own helpers that need a running Spark query (``sequin_provider.spark.app``)."""

from __future__ import annotations

import time
from typing import Any

from sequin_provider.spark.app import progress_since


class PublicQuery:
    """A query seen only through PySpark's public API (as over Spark Connect): no JVM handle."""

    def __init__(self, query: Any) -> None:
        self.recentProgress = query.recentProgress


def test_progress_since_gives_the_reports_after_a_batch_oldest_first(spark: Any) -> None:
    """Each report after the given batch, oldest first, equal to Spark's own (``recentProgress``),
    whether read through the JVM handle or, without one, through the public API."""
    query = spark.readStream.format("rate").option("rowsPerSecond", 50).load().writeStream.format("noop").start()
    try:
        deadline = time.monotonic() + 120
        while (query.lastProgress is None or query.lastProgress.batchId < 6) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        query.stop()
    everything = query.recentProgress
    ids = [p.batchId for p in everything]
    assert len(ids) >= 7 and ids == sorted(ids)
    middle = ids[len(ids) // 2]
    for view in (query, PublicQuery(query)):
        assert [p.json for p in progress_since(view, None)] == [p.json for p in everything]
        assert [p.json for p in progress_since(view, middle)] == [p.json for p in everything if p.batchId > middle]
        assert progress_since(view, ids[-1]) == []
