"""The operators without a server: spark-submit targets and environment, backfill requests checked
before any I/O, the supervisor's heartbeat watch and backoff, the provider info, a connection and
config naming different servers (against real Postgres and spark-submit:
tests/integration/airflow/test_operators.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.replication import (
    HeartbeatWatch,
    backoff_delay,
)
from sequin_provider.operators.spark_submit import SparkTarget, resolve_target, submit_conf, submit_env
from sequin_provider.spark.local_checkpoint import JAR_ENV


def test_spark_connection_with_local_master_and_client_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_LOCAL", json.dumps({"conn_type": "spark", "host": "local[*]"}))
    target = resolve_target("spark_local")
    assert target == SparkTarget("local[*]", None) and target.is_local and not target.is_cluster
    env = submit_env(target, {"EXTRA": 1})
    assert env is not None
    assert env["PYSPARK_PYTHON"] == env["PYSPARK_DRIVER_PYTHON"] == sys.executable
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["EXTRA"] == "1"
    # the driver runs on the cluster: nothing of this machine is imposed on it
    assert submit_env(SparkTarget("spark://m:7077", "cluster"), None) is None
    assert "PYSPARK_PYTHON" not in (submit_env(SparkTarget("yarn", None), None) or {})


def test_a_driver_here_gets_the_checkpoint_jar_on_its_class_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Client mode: the jar this machine built goes first on the driver's class path (a local
    checkpoint without forked chmods); not for a driver on the cluster, nor over the user's own
    class path, nor when there is no jar."""
    jar = tmp_path / "sequin-spark.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv(JAR_ENV, str(jar))
    here, there = SparkTarget("local[2]", None), SparkTarget("spark://m:7077", "cluster")
    assert submit_conf(here, {"spark.x": "1"}) == {"spark.x": "1", "spark.driver.extraClassPath": str(jar)}
    assert submit_conf(SparkTarget("yarn", None), None) == {"spark.driver.extraClassPath": str(jar)}
    assert submit_conf(there, {"spark.x": "1"}) == {"spark.x": "1"}
    assert submit_conf(here, {"spark.driver.extraClassPath": "/theirs.jar"}) == {
        "spark.driver.extraClassPath": "/theirs.jar"
    }
    monkeypatch.setenv(JAR_ENV, "off")
    assert submit_conf(here, None) == {}


def test_the_configs_connections_reach_the_app_as_environment_only_where_the_hook_keeps_them_off_the_command_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections = {"pg_src": "host=db port=5 user=u password=secret-pw dbname=d"}
    env = submit_env(SparkTarget("local[1]", None), {"AIRFLOW_CONN_OTHER": "x"}, connections)
    assert env is not None and env["AIRFLOW_CONN_PG_SRC"] == "postgresql://u:secret-pw@db:5/d"
    assert env["AIRFLOW_CONN_OTHER"] == "x"
    assert submit_env(SparkTarget("spark://m:7077", None), None, connections)["AIRFLOW_CONN_PG_SRC"]  # type: ignore[index]
    # YARN and Kubernetes: SparkSubmitHook turns env_vars into --conf on the command line; cluster mode: not here
    for target in (
        SparkTarget("yarn", None),
        SparkTarget("k8s://https://k:443", None),
        SparkTarget("spark://m:7077", "cluster"),
    ):
        assert not any(k.startswith("AIRFLOW_CONN_") for k in (submit_env(target, None, connections) or {}))
    assert "pg_src" in caplog.text and "secret-pw" not in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "sideways"}, "kind must be 'full' or 'partial'"),
        ({"kind": "full", "sort_column": "updated_at"}, "a full backfill takes no sort column"),
        ({"kind": "partial"}, "a partial backfill needs a sort column"),
        ({"sort_column": "updated_at"}, "a partial backfill needs a sort column and a start position"),
        ({"max_query_ms": 0}, "max_query_ms must be an integer between 1 and 600000"),
        ({"max_query_ms": "fast"}, "max_query_ms must be an integer"),
        ({"sink": ""}, "a backfill needs a sink and a table"),
    ],
)
def test_backfill_request_is_checked_before_any_io(kwargs: dict[str, Any], message: str) -> None:
    op = SequinBackfillOperator(task_id="b", **{"sink": "s", "table": "t", "sequin_conn_id": "missing", **kwargs})
    with pytest.raises(AirflowFailException, match=message):
        op.execute(context={})


def test_backfill_request_from_templates_normalises_values() -> None:
    op = SequinBackfillOperator(
        task_id="b",
        sink="s",
        table="t",
        kind="",
        sort_column="updated_at",
        start_position="2025-01-01",
        max_query_ms="250",
        where="  status = 'paid'\n",
    )
    assert "where" in SequinBackfillOperator.template_fields
    assert op.request() == {
        "sink": "s",
        "table": "t",
        "sort_column": "updated_at",
        "start_position": "2025-01-01",
        "max_query_ms": 250,
        "where": "status = 'paid'",
    }  # kind inferred: partial
    assert SequinBackfillOperator(task_id="b", sink="s", table="t", where="").request()["where"] is None


def test_heartbeat_watch_judges_by_change_on_its_own_clock() -> None:
    watch = HeartbeatWatch(start_timeout=60, stall_timeout=10, started=1000.0, baseline="old")
    watch.observe("old", 1030.0)  # the previous run's heartbeat is no sign of life
    assert not watch.stalled(1060.0) and watch.stalled(1060.5)
    watch.observe("b1", 1050.0)
    assert not watch.stalled(1060.0) and watch.stalled(1060.5)
    watch.observe(None, 1059.0)  # store unreachable: no reading, no verdict change
    watch.observe("b1", 1059.0)  # the same heartbeat again is not a new one
    assert watch.stalled(1061.0)
    watch.observe("b2", 1061.0)
    assert not watch.stalled(1070.0) and watch.healthy_for(1070.0) == 20.0


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_delay(n, 10, 300) for n in (1, 2, 3, 4, 5, 6)] == [10, 20, 40, 80, 160, 300]


def test_provider_info_declares_the_operators() -> None:
    import airflow
    import jsonschema

    import sequin_provider
    from sequin_provider.operators import sequin as operators

    info = sequin_provider.get_provider_info()
    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    (entry,) = info["operators"]
    assert entry["python-modules"] == ["sequin_provider.operators.sequin"]
    assert set(operators.__all__) == {
        "SequinBackfillOperator",
        "SequinBackfillServerOperator",
        "SequinBufferRetryOperator",
        "SequinFreshnessOperator",
        "SequinReplayOperator",
        "SequinReplicationOperator",
    }


def test_a_connection_and_config_naming_different_servers_is_warned_about() -> None:
    from sequin_provider.operators.common import warn_if_elsewhere

    class Log:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def warning(self, message: str, *args: Any) -> None:
            self.lines.append(message % args)

    log = Log()
    warn_if_elsewhere(log, "store", "host=db port=5432 dbname=shop user=a", "postgresql://b@db:5432/shop")
    assert log.lines == []  # same server and database, other credentials
    warn_if_elsewhere(log, "store", "host=db port=5432 dbname=shop", "postgresql://db:5432/ops")
    assert log.lines == [
        "the store of the sequin connection (db:5432/shop) differs from the config's (db:5432/ops):"
        " the operator and the Spark app must reach the same database"
    ]
