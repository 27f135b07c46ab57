"""spark/arrow_map: the stream app's ``mapInArrow`` with its function pickled once per app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyspark.serializers import CloudPickleSerializer

from sequin_provider.spark.arrow_map import ArrowMap

SCHEMA = "id long, doubled long, tag string"


def doubled(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A map that shows each input row came through it once."""
    for batch in batches:
        ids = batch.column("id").to_pylist()
        yield pa.RecordBatch.from_pydict(
            {"id": ids, "doubled": [2 * i for i in ids], "tag": batch.column("tag").to_pylist()}
        )


@pytest.fixture
def pickles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many commands PySpark pickles for the JVM (a UDF's function is one)."""
    calls: list[int] = []
    dumps = CloudPickleSerializer.dumps

    def counting(self: CloudPickleSerializer, obj: Any) -> bytes:
        calls.append(1)
        return dumps(self, obj)

    monkeypatch.setattr(CloudPickleSerializer, "dumps", counting)
    return calls


def frames(spark: Any) -> list[Any]:
    """Three micro-batch-like DataFrames of one schema, each with other rows."""
    return [
        spark.range(n * 100, n * 100 + 50 + n, numPartitions=2).selectExpr("id", f"'batch {n}' AS tag")
        for n in range(3)
    ]


def test_it_maps_each_frame_as_map_in_arrow_does(spark: Any) -> None:
    mapped = ArrowMap(doubled, SCHEMA)
    for frame in frames(spark):
        expected = sorted(frame.mapInArrow(doubled, SCHEMA).collect())
        got = sorted(mapped(frame).collect())
        assert got == expected
        assert len(got) == frame.count()
        assert all(row.doubled == 2 * row.id for row in got)


def test_columns_are_found_by_name_in_each_frame(spark: Any) -> None:
    """The UDF is applied to each column list once, by name: a frame with the same names in
    another order, or with other names, maps its own columns."""
    mapped = ArrowMap(doubled, SCHEMA)
    first = frames(spark)[0]
    swapped = first.select("tag", "id")
    renamed = first.selectExpr("id + 1000 AS id", "tag", "'x' AS `odd name`")
    assert sorted(mapped(first).collect()) == sorted(first.mapInArrow(doubled, SCHEMA).collect())
    assert sorted(mapped(swapped).collect()) == sorted(swapped.mapInArrow(doubled, SCHEMA).collect())
    assert sorted(r.id for r in mapped(renamed).collect()) == list(range(1000, 1050))


def test_the_function_is_pickled_once_for_many_batches(spark: Any, pickles: list[int]) -> None:
    mapped = ArrowMap(doubled, SCHEMA)
    for frame in frames(spark):
        assert mapped(frame).count() == frame.count()
    assert len(pickles) == 1

    pickles.clear()  # the same batches through mapInArrow: one pickle each
    for frame in frames(spark):
        frame.mapInArrow(doubled, SCHEMA).count()
    assert len(pickles) == 3


def test_after_the_session_is_replaced_it_maps_in_the_new_one(spark: Any) -> None:
    """The UDF's JVM function outlives its SparkContext: a restarted session in the same process
    (a test's, an app's) maps with the same UDF. Last in the module: it stops the module's session."""
    from sequin_provider.spark.app import spark_session

    mapped = ArrowMap(doubled, SCHEMA)
    assert mapped(frames(spark)[0]).count() == 50
    spark.stop()
    again = spark_session("sequin-arrow-map-tests-again", "local[2]")
    try:
        assert sorted(r.doubled for r in mapped(frames(again)[1]).collect()) == [2 * i for i in range(100, 151)]
    finally:
        again.stop()
