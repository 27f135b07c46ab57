"""The stream app's own helpers that need a running Spark query (``sequin_provider.spark.app``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sequin_provider.spark.app import SPOOL_PLAN_CONF, plan_spool_batches_simply, progress_since


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


def test_a_spool_app_plans_without_code_generation_and_a_full_app_keeps_sparks_defaults(
    spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``payload=spool`` batches carry slices, not changes: no whole-stage code generation and the
    simple plan string; a ``payload=full`` app's session is left as Spark set it."""
    try:
        plan_spool_batches_simply(spark, "full")
        assert [str(spark.conf.get(k)).lower() for k in SPOOL_PLAN_CONF] == ["true", "formatted"]
        plan_spool_batches_simply(spark, "spool")
        assert {k: spark.conf.get(k) for k in SPOOL_PLAN_CONF} == {
            "spark.sql.codegen.wholeStage": "false",
            "spark.sql.ui.explainMode": "simple",
        }

        def plan() -> str:  # a new DataFrame each time: a DataFrame keeps the plan it made first
            capsys.readouterr()
            spark.createDataFrame([("a", 0, 10)], "spool_path string, spool_offset long, spool_rows long").where(
                "spool_rows > 0"
            ).explain()
            return capsys.readouterr().out

        simple = plan()
        assert "Filter" in simple and "*(" not in simple  # "*(1) Filter": a whole-stage code generation stage
        spark.conf.set("spark.sql.codegen.wholeStage", "true")
        assert "*(1) Filter" in plan()
    finally:
        for key in SPOOL_PLAN_CONF:
            spark.conf.unset(key)
