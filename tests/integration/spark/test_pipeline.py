"""spark/pipeline: the executors' selection of ``payload=spool`` slices, held equal to Spark SQL's.

End to end the pipeline is exercised by test_stream_app and test_backfill_app; here the one piece of
logic that exists twice, a sink's selection (``delivery.selection_predicate`` evaluated by Spark for
``payload=full``, ``message_render.selection`` over Arrow for ``payload=spool``), is compared row by
row over every combination of table, action and backfill sink.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from sequin_provider.change_arrow import rows_to_arrow
from sequin_provider.config import load_config
from sequin_provider.delivery import selection_predicate
from sequin_provider.message_render import SinkRendering, selection
from sequin_provider.messages import CHANGE_SCHEMA_DDL
from sequin_provider.spark.pipeline import with_selections
from tests.support.config import write_config

TABLES = [("public", "t"), ("other", "t2"), ("public", "unlisted"), ("", "sequin:backfill:low")]
ACTIONS = ["insert", "update", "delete", "read", "message"]
BACKFILL_SINKS = [None, "changes", "rows", "somebody_else"]


def rows() -> list[tuple]:
    """One change row per (table, action, backfill sink), in position order."""
    out = []
    for n, ((schema, table), action, backfill_sink) in enumerate(itertools.product(TABLES, ACTIONS, BACKFILL_SINKS)):
        out.append(
            (
                1000 + n,
                0,
                "2026-11-24T08:00:00Z",
                7,
                schema,
                table,
                action,
                f'{{"id":{n}}}',
                None,
                [str(n)],
                [],
                3 if action == "read" else None,
                backfill_sink,
            )
        )
    return out


def test_the_executors_selection_equals_spark_sqls_for_every_sink_without_a_filter(tmp_path: Path, spark: Any) -> None:
    """For every sink ``payload=spool`` serves (no filter, no custom groups), the Arrow selection takes
    exactly the rows the SQL predicate takes: its tables, its actions (a record sink no deletes),
    reads of its own backfills only, never a logical message."""
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            """
        databases: [{name: app, dsn: "postgresql://u@localhost/app"}]
        sinks:
          - {name: changes, tables: [public.t, other.t2], destination: {type: sequin_stream}}
          - {name: rows, tables: [public.t], message_kind: record, destination: {type: sequin_stream}}
          - {name: inserts, tables: [other.t2], actions: [insert], destination: {type: sequin_stream}}
          - {name: deletes, tables: [public.t], actions: [delete], transform: record_only,
             destination: {type: sequin_stream}}
        """,
        )
    )
    batch = rows_to_arrow(rows())
    frame = spark.createDataFrame(rows(), CHANGE_SCHEMA_DDL)
    for sink in config.sinks:
        by_sql = [r[0] for r in frame.select(F.coalesce(F.expr(selection_predicate(sink)), F.lit(False))).collect()]
        by_arrow = selection(batch, SinkRendering.of(sink, "app")).to_pylist()
        assert by_arrow == by_sql, sink.name
        assert 0 < sum(by_sql) < len(by_sql), sink.name  # the comparison means something for each sink

    renderings = [SinkRendering.of(s, "app") for s in config.sinks]
    selected = with_selections(batch, renderings)
    flags = [selection(batch, r).to_pylist() for r in renderings]
    kept = [n for n in range(batch.num_rows) if any(f[n] for f in flags)]
    assert selected.column("commit_lsn").to_pylist() == [1000 + n for n in kept]  # rows no sink takes go, in order
    for i, f in enumerate(flags):
        assert selected.column(f"_select_{i}").to_pylist() == [f[n] for n in kept]
    assert with_selections(rows_to_arrow(rows()[-4:]), renderings).num_rows == 0  # only logical messages


def test_a_worker_keeps_its_writers_across_tasks(tmp_path: Path) -> None:
    """Spark ships the ``mapInArrow`` functions to every task pickled (by value, with copies of the
    globals they name); a Python worker must still make its writers, each with its store connection,
    once, not once per task (that was a new store backend per task and micro-batch)."""
    import pickle

    from pyspark import cloudpickle

    from sequin_provider.spark import pipeline

    config_path = str(
        write_config(
            tmp_path / "sequin.yaml",
            """
        databases: [{name: app, dsn: "postgresql://u@localhost/app"}]
        sinks:
          - {name: changes, tables: [public.t], destination: {type: sequin_stream}}
          - {name: hook, tables: [public.t], destination: {type: webhook, url: "http://localhost:9/hook"}}
    """,
        )
    )
    shipped = [
        cloudpickle.dumps(pipeline.write_partitions(config_path, "app")),
        cloudpickle.dumps(pipeline.push_partitions(config_path, "app", "hook")),
    ]
    seen: list[tuple[int, int]] = []
    for _task in range(3):
        write, push = (pickle.loads(p) for p in shipped)
        write(iter([])), push(iter([]))  # generators: the writers are made, nothing is written yet
        seen.append(
            (id(pipeline._WRITERS[(config_path, "app")]), id(pipeline._PUSHERS[(config_path, "app", "hook", 1)]))
        )
    assert len(set(seen)) == 1


def test_the_push_shares_of_a_spooled_batch_send_each_group_once_in_order_from_its_first_slice(
    dsn: str, tmp_path: Path
) -> None:
    """With ``payload=spool`` every task reads the batch's whole spool file and sends the groups
    whose first message lies in its own slice: the shares of all slices send every message once,
    a group entirely by one task (even when it continues into the next slice), in position order.
    Real store (the parked-groups check) and a real HTTP endpoint."""
    import psycopg

    from sequin_provider import store
    from sequin_provider.spark.pipeline import PushWriter
    from sequin_provider.spark.spool import write_spool
    from tests.support.receiver import Receiver

    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    receiver = Receiver().start()
    try:
        config_path = str(
            write_config(
                tmp_path / "sequin.yaml",
                f"""
            databases: [{{name: app, dsn: "{dsn}"}}]
            sinks:
              - {{name: hook, tables: [public.t], destination: {{type: webhook, url: "{receiver.url}", batch_size: 3,
                  concurrency: 4}}}}
              - {{name: solo, tables: [public.t], message_grouping: false, destination: {{type: webhook,
                  url: "{receiver.url}", batch_size: 3, concurrency: 4}}}}
        """,
            )
        )

        def key(n: int) -> int:  # keys 0-3 start in the first slice and go on in the second; 4-6 start there
            return n % 4 if n < 12 or n % 2 == 0 else 4 + n % 3

        theirs = {n for n in range(30) if n % 5 == 4}  # another table's changes: not this sink's
        changes = [
            (
                1000 + n,
                0,
                "2026-11-25T08:00:00Z",
                7,
                *(("other", "t2") if n in theirs else ("public", "t")),
                "insert",
                f'{{"id":{key(n)},"n":{n}}}',
                None,
                [str(key(n))],
                [],
                None,
                None,
            )
            for n in range(30)
        ]
        # a backfill's read of key 1 comes last in the file, at its window's position (1001, 1): before n=5
        changes.append(
            (1001, 1, "2026-11-25T08:00:00Z", 0, "public", "t", "read", '{"id":1,"n":30}', None, ["1"], [], 3, "hook")
        )
        position = {c[7]: (c[0], c[1]) for c in changes}
        path = str(tmp_path / "batch.arrow")
        write_spool(path, rows_to_arrow(changes))
        writer = PushWriter(config_path, "app", "hook")
        shares = []
        for offset, count in ((0, 12), (12, 19)):
            before = len(receiver.messages())
            delivered, parked = writer.write_share([(path, offset, count)])
            shares.append(receiver.messages()[before:])
            assert (delivered, parked) == (len(shares[-1]), 0)
        solo = PushWriter(config_path, "app", "solo")  # every message its own group: each task sends its slice
        solo_shares = []
        for offset, count in ((0, 12), (12, 19)):
            before = len(receiver.messages())
            mine = [n for n in range(offset, min(offset + count, 30)) if n not in theirs]  # 30: hook's backfill read
            assert solo.write_share([(path, offset, count)]) == (len(mine), 0)
            solo_shares.append(sorted(m["record"]["n"] for m in receiver.messages()[before:]))
    finally:
        receiver.stop()
    assert solo_shares == [[n for n in range(12) if n not in theirs], [n for n in range(12, 30) if n not in theirs]]
    sent = [m for share in shares for m in share]
    assert sorted(m["record"]["n"] for m in sent) == [n for n in range(31) if n not in theirs]  # each once
    assert {m["record"]["id"] for m in shares[1]} == {4, 5, 6}
    for k in range(7):
        ns = sorted(
            (n for n in range(31) if (key(n) if n < 30 else 1) == k and n not in theirs),
            key=lambda n: position[f'{{"id":{k},"n":{n}}}'],
        )
        owner = 0 if ns[0] < 12 else 1
        assert [m["record"]["n"] for m in shares[owner] if m["record"]["id"] == k] == ns  # whole group, in order
        assert not [m for m in shares[1 - owner] if m["record"]["id"] == k]


def logged_batch(checkpoint: Path, batch_id: int, offset: dict[str, int]) -> None:
    """An entry of Spark's offset log as Spark 4 writes it: version, the batch's metadata, the source's offset."""
    import json

    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    metadata = {"batchWatermarkMs": 0, "batchTimestampMs": 1795785599749, "conf": {}}
    (checkpoint / "offsets" / str(batch_id)).write_text(f"v1\n{json.dumps(metadata)}\n{json.dumps(offset)}")


def test_the_driver_writes_a_small_spooled_batch_and_hands_a_broken_one_to_spark(dsn: str, tmp_path: Path) -> None:
    """``Pipeline.deliver_on_driver``: the batch's spool file is named by the offsets Spark logged for
    it and the batch before; up to ``stream.driver_batch_rows`` changes are written here, exactly, and
    a larger batch, a batch with no batch before it in the log, or a spool file the driver cannot read
    is left to the Spark job (None), with nothing written."""
    import psycopg

    from sequin_provider import store
    from sequin_provider.spark.pipeline import Pipeline
    from sequin_provider.spark.spool import spool_path, write_spool

    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            f"""
        databases: [{{name: app, dsn: "{dsn}"}}]
        sinks: [{{name: changes, tables: [public.t], destination: {{type: sequin_stream}}}}]
        stream: {{driver_batch_rows: 30}}
        """,
        )
    )
    checkpoint, spool = tmp_path / "ckpt", tmp_path / "ckpt" / "spool"
    spool.mkdir(parents=True)
    logged_batch(checkpoint, 4, {"lsn": 1000})
    logged_batch(checkpoint, 5, {"lsn": 2000, "idx": 3})
    logged_batch(checkpoint, 6, {"lsn": 3000})
    changes = [r for r in rows() if r[4:6] == ("public", "t")]  # the sink's table: all actions, reads, messages
    flags = selection(rows_to_arrow(changes), SinkRendering.of(config.sinks[0], "app")).to_pylist()
    taken = [r for r, wanted in zip(changes, flags) if wanted]
    assert 0 < len(taken) < len(changes)
    write_spool(spool_path(str(spool), (1000, 0), (2000, 3)), rows_to_arrow(changes))
    write_spool(spool_path(str(spool), (2000, 3), (3000, 0)), rows_to_arrow(rows()))  # 100 rows: too many
    pipeline = Pipeline(config, "app")
    assert pipeline.deliver_on_driver(5) is None  # not asked to (write_small_batches): Spark's job
    pipeline.write_small_batches(str(checkpoint), f"file://{spool}", local_master=True)
    assert pipeline.deliver_on_driver(4) is None  # no batch 3 in the log: where batch 4 starts is unknown
    assert pipeline.deliver_on_driver(6) is None  # 100 changes > driver_batch_rows
    with psycopg.connect(dsn) as conn:
        assert store.stream_messages(conn, "sequin", "changes", visible_only=False) == []

    delivered = pipeline.deliver_on_driver(5)
    assert delivered is not None
    report, committed = delivered
    assert committed == []  # no batched sink
    assert report.column("rows").to_pylist() == [len(changes)]
    assert report.column("written").to_pylist() == [len(taken)]
    with psycopg.connect(dsn) as conn:
        stored = store.stream_messages(conn, "sequin", "changes", visible_only=False)
    assert [(m.commit_lsn, m.commit_idx) for m in stored] == [(r[0], r[1]) for r in taken]

    broken = spool_path(str(spool), (2000, 3), (3000, 0))
    with open(broken, "wb") as f:
        f.write(b"ARROW1 cut short")
    logged_batch(checkpoint, 6, {"lsn": 3000})
    assert pipeline.deliver_on_driver(6) is None  # unreadable here: the job re-reads the range from the slot
    with psycopg.connect(dsn) as conn:
        assert len(store.stream_messages(conn, "sequin", "changes", visible_only=False)) == len(taken)


def test_the_driver_sends_a_push_sink_over_the_lanes_of_all_the_jobs_tasks(dsn: str, tmp_path: Path) -> None:
    """A spooled batch the driver writes goes to a webhook over ``concurrency`` lanes times the tasks
    its job would run (``write_small_batches(tasks=...)``), as the job's tasks would send it together:
    a real endpoint holding every request sees that many at once, and every message, each group's
    in position order."""
    import psycopg

    from sequin_provider import store
    from sequin_provider.spark.pipeline import Pipeline
    from sequin_provider.spark.spool import spool_path, write_spool
    from tests.support.receiver import Receiver

    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    receiver = Receiver().start()
    receiver.policy = lambda messages: (200, 0.3)
    try:
        config = load_config(
            write_config(
                tmp_path / "sequin.yaml",
                f"""
            databases: [{{name: app, dsn: "{dsn}"}}]
            sinks:
              - name: hook
                tables: [public.t]
                destination: {{type: webhook, url: "{receiver.url}", batch_size: 1, concurrency: 2}}
            """,
            )
        )
        checkpoint, spool = tmp_path / "ckpt", tmp_path / "ckpt" / "spool"
        spool.mkdir(parents=True)
        logged_batch(checkpoint, 1, {"lsn": 1000})
        logged_batch(checkpoint, 2, {"lsn": 2000})
        changes = [r for r in rows() if r[4:6] == ("public", "t")]
        write_spool(spool_path(str(spool), (1000, 0), (2000, 0)), rows_to_arrow(changes))
        expected = [
            r[0]
            for r, wanted in zip(
                changes, selection(rows_to_arrow(changes), SinkRendering.of(config.sinks[0], "app")).to_pylist()
            )
            if wanted
        ]
        assert len(expected) >= 8  # more groups than lanes

        pipeline = Pipeline(config, "app")
        pipeline.write_small_batches(str(checkpoint), str(spool), local_master=True, tasks=2)
        try:
            delivered = pipeline.deliver_on_driver(2)
        finally:
            pipeline.close()
        assert delivered is not None
        report, _ = delivered
        assert report.column("delivered").to_pylist() == [len(expected)]
        assert sorted(m["metadata"]["commit_lsn"] for m in receiver.messages()) == expected
        assert receiver.peak_in_flight == 4  # 2 lanes x 2 tasks
    finally:
        receiver.stop()


def test_the_driver_commits_a_batched_sinks_share_of_a_small_spooled_batch_once(dsn: str, tmp_path: Path) -> None:
    """A spooled batch the driver writes also goes to a batched sink (Iceberg, a real SQL catalog in
    sqlite and a warehouse under tmp_path) from the same spool file, without a Spark job: its changelog
    holds exactly the sink's messages, in position order, and the batch written again (a replay)
    commits nothing more."""
    pytest.importorskip("pyiceberg", reason="needs pip install 'sequin-provider[iceberg]'")
    import psycopg

    from sequin_provider import store
    from sequin_provider.sinks.iceberg_tables import open_catalog
    from sequin_provider.spark.pipeline import Pipeline
    from sequin_provider.spark.spool import spool_path, write_spool

    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    config = load_config(
        write_config(
            tmp_path / "sequin.yaml",
            f"""
        databases: [{{name: app, dsn: "{dsn}"}}]
        sinks:
          - {{name: changes, tables: [public.t], destination: {{type: sequin_stream}}}}
          - name: lake
            tables: [public.t]
            destination:
              type: iceberg
              catalog: {{uri: "sqlite:///{tmp_path}/catalog.db", warehouse: "file://{tmp_path}/warehouse"}}
        """,
        )
    )
    checkpoint, spool = tmp_path / "ckpt", tmp_path / "ckpt" / "spool"
    spool.mkdir(parents=True)
    logged_batch(checkpoint, 1, {"lsn": 1000})
    logged_batch(checkpoint, 2, {"lsn": 2000})
    changes = [r for r in rows() if r[4:6] == ("public", "t")]
    write_spool(spool_path(str(spool), (1000, 0), (2000, 0)), rows_to_arrow(changes))
    lake = config.sink("lake")
    flags = selection(rows_to_arrow(changes), SinkRendering.of(lake, "app")).to_pylist()
    expected = [(r[0], r[1], r[6]) for r, wanted in zip(changes, flags) if wanted]
    assert 0 < len(expected) < len(changes)

    pipeline = Pipeline(config, "app")
    pipeline.write_small_batches(str(checkpoint), str(spool), local_master=True)
    options = lake.destination.options
    catalog = open_catalog(options)
    try:
        for attempt in range(2):  # the second: the batch again, as after a crash before Spark's commit
            delivered = pipeline.deliver_on_driver(2)
            assert delivered is not None
            report, [committed] = delivered
            assert report.column("rows").to_pylist() == [len(changes)]
            assert committed.column("delivered").to_pylist() == [len(expected)]
            table = catalog.load_table(options.identifier("public", "t"))
            landed = table.scan().to_arrow().sort_by([("commit_lsn", "ascending"), ("commit_idx", "ascending")])
            assert (
                list(zip(*(landed.column(c).to_pylist() for c in ("commit_lsn", "commit_idx", "action")))) == expected
            )
            assert len(table.snapshots()) == 1  # one commit, the replay none
    finally:
        catalog.engine.dispose()
        pipeline.close()


def test_a_batch_the_driver_fails_after_its_copy_is_left_to_the_job_whose_rewrite_adds_nothing(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's COPY committed, then its push share failed (a failure injected into the push
    writer, which a real endpoint would not raise: it parks): ``deliver_on_driver`` leaves the batch
    to the Spark job (None), and the job's task, writing the same spool rows at the same positions,
    stores nothing twice."""
    import psycopg

    from sequin_provider import store
    from sequin_provider.spark import pipeline as pipeline_module
    from sequin_provider.spark.pipeline import Pipeline
    from sequin_provider.spark.source import spool_slice
    from sequin_provider.spark.spool import spool_path, write_spool

    with psycopg.connect(dsn) as conn:
        store.migrate(conn, "sequin")
        conn.commit()
    config_path = write_config(
        tmp_path / "sequin.yaml",
        f"""
        databases: [{{name: app, dsn: "{dsn}"}}]
        sinks:
          - {{name: changes, tables: [public.t], destination: {{type: sequin_stream}}}}
          - {{name: hook, tables: [public.t], destination: {{type: webhook, url: "http://127.0.0.1:9/hook"}}}}
        """,
    )
    config = load_config(config_path)
    checkpoint, spool = tmp_path / "ckpt", tmp_path / "ckpt" / "spool"
    spool.mkdir(parents=True)
    logged_batch(checkpoint, 1, {"lsn": 1000})
    logged_batch(checkpoint, 2, {"lsn": 2000})
    changes = [r for r in rows() if r[4:6] == ("public", "t")]
    path = spool_path(str(spool), (1000, 0), (2000, 0))
    write_spool(path, rows_to_arrow(changes))
    expected = sum(selection(rows_to_arrow(changes), SinkRendering.of(config.sinks[0], "app")).to_pylist())

    def unreachable(*_args: object) -> None:
        raise ConnectionError("injected: the push share failed after the COPY")

    monkeypatch.setattr(pipeline_module, "push_writer", unreachable)
    pipeline = Pipeline(config, "app")
    pipeline.write_small_batches(str(checkpoint), str(spool), local_master=True)
    assert pipeline.deliver_on_driver(2) is None  # left to the job
    with psycopg.connect(dsn) as conn:
        written = store.stream_messages(conn, "sequin", "changes", visible_only=False)
    assert len(written) == expected > 0  # the driver's COPY had committed

    monkeypatch.undo()  # the job's task: the same writer over the same spool rows
    task = pipeline_module.StreamWriter(str(config_path), "app")
    try:
        [report] = list(task.write(spool_slice(path, 0, len(changes))))
    finally:
        task.close()
    assert report.column("rows").to_pylist() == [len(changes)]
    with psycopg.connect(dsn) as conn:
        again = store.stream_messages(conn, "sequin", "changes", visible_only=False)
    assert [(m.commit_lsn, m.commit_idx) for m in again] == [(m.commit_lsn, m.commit_idx) for m in written]
    pipeline.close()


def test_on_a_cluster_the_driver_writes_nothing_unless_told_to(tmp_path: Path) -> None:
    """Unset, ``stream.driver_batch_rows`` is every batch (``max_batch_rows``) on a local master, push
    sink or not, and 0 on a cluster, whose driver may not reach what the executors do; set, it holds
    on a cluster too. The driver's push writer sends over the lanes of all the job's tasks together."""
    from sequin_provider.spark.pipeline import Pipeline, StreamWriter, push_writer

    stored = "{name: changes, tables: [public.t], destination: {type: sequin_stream}}"
    pushed = (
        '{name: hook, tables: [public.t], destination: {type: webhook, url: "http://127.0.0.1:9/h", concurrency: 3}}'
    )

    def pipeline_of(stream: str, local_master: bool, sinks: str = stored, tasks: int = 1) -> Pipeline:
        config = load_config(
            write_config(
                tmp_path / "sequin.yaml",
                f"""
            databases: [{{name: app, dsn: "postgresql://u@localhost/app"}}]
            sinks: [{sinks}]
            {stream}
            """,
            )
        )
        pipeline = Pipeline(config, "app")
        pipeline.write_small_batches(str(tmp_path / "ckpt"), str(tmp_path / "spool"), local_master, tasks)
        return pipeline

    def limit(stream: str, local_master: bool, sinks: str = stored) -> int:
        return pipeline_of(stream, local_master, sinks).driver_batch_rows

    assert limit("", local_master=True) == 200_000  # stream.max_batch_rows' default
    assert limit("stream: {max_batch_rows: 5000}", local_master=True) == 5000
    assert limit("", local_master=True, sinks=f"{stored}, {pushed}") == 200_000
    assert limit("", local_master=False) == 0
    assert limit("", local_master=False, sinks=pushed) == 0
    assert limit("stream: {driver_batch_rows: 500}", local_master=False) == 500
    assert limit("stream: {driver_batch_rows: 0}", local_master=True) == 0

    pipeline = pipeline_of("", local_master=True, sinks=f"{stored}, {pushed}", tasks=2)
    assert pipeline.driver_lane_factor == 2
    config_path = str(tmp_path / "sequin.yaml")
    assert push_writer(config_path, "app", "hook").pusher.lanes == 3  # a task's: the sink's concurrency
    assert StreamWriter(config_path, "app", pipeline.driver_lane_factor).lane_factor == 2
    assert push_writer(config_path, "app", "hook", pipeline.driver_lane_factor).pusher.lanes == 6  # the driver's
