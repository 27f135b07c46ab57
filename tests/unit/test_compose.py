"""docker-compose.yaml cannot run here (no Docker engine); its structure is checked instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sequin_provider.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


def env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_services_and_images() -> None:
    services = compose()["services"]
    assert set(services) == {
        "postgres",
        "airflow-init",
        "airflow-api-server",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "spark-master",
        "spark-worker",
        "stream-api",
    }
    assert "wal_level=logical" in services["postgres"]["command"]
    assert services["spark-master"]["image"].startswith("apache/spark:4.2.0")
    built = [n for n, s in services.items() if s.get("image") == "sequin-provider-airflow:latest"]
    assert set(built) >= {
        "airflow-api-server",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "spark-worker",
        "stream-api",
        "airflow-init",
    }
    for name in ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        assert services[name]["command"][:2] == ["airflow", name.removeprefix("airflow-")]
        assert services[name]["depends_on"]["airflow-init"] == {"condition": "service_completed_successfully"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM apache/airflow:3." in dockerfile and "openjdk-17" in dockerfile and "pip install" in dockerfile


def test_airflow_environment_connections_and_volumes() -> None:
    services = compose()["services"]
    scheduler = services["airflow-scheduler"]
    e = env(scheduler)
    assert e["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor" and e["AIRFLOW__CORE__LOAD_EXAMPLES"] == "false"
    assert e["AIRFLOW_CONN_SPARK_DEFAULT"] == "spark://spark-master:7077"
    assert '"conn_type": "sequin"' in e["AIRFLOW_CONN_SEQUIN_DEFAULT"]
    assert e["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith("@postgres:5432/airflow")
    assert e["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/sequin/dags"
    assert "./dags:/opt/sequin/dags:ro" in scheduler["volumes"]
    assert any(v.endswith("init-airflow-db.sql:ro") for v in services["postgres"]["volumes"])
    assert (ROOT / "compose" / "init-airflow-db.sql").read_text().strip().endswith("CREATE DATABASE airflow;")
    assert set(compose()["volumes"]) == {"pgdata", "checkpoints"}
    assert services["stream-api"]["ports"] == ["7376:7376"]


def test_the_compose_config_is_valid_for_the_compose_connections() -> None:
    scheduler_env = env(compose()["services"]["airflow-scheduler"])
    config = load_config(ROOT / "sequin.compose.yaml", environ=scheduler_env)
    assert config.database().dsn == "postgresql://sequin:sequin@postgres:5432/shop"
    assert config.stream.checkpoint_location == "/var/lib/sequin/checkpoints"


def test_the_spark_worker_reads_the_config_its_connections_and_the_spool_as_the_driver_does() -> None:
    """The stream app's executors read the config at the driver's path, resolve its connections in
    their own environment and read the default spool (under the checkpoint) on the same volume."""
    services = compose()["services"]
    worker, scheduler = services["spark-worker"], services["airflow-scheduler"]
    config_mount = next(v for v in scheduler["volumes"] if "sequin.compose.yaml" in v)
    checkpoint_mount = next(v for v in scheduler["volumes"] if v.startswith("checkpoints:"))
    assert config_mount in worker["volumes"] and checkpoint_mount in worker["volumes"]
    config = load_config(ROOT / "sequin.compose.yaml", environ=env(worker))
    assert config.database().dsn == load_config(ROOT / "sequin.compose.yaml", environ=env(scheduler)).database().dsn
    assert config.stream.spool_location is None  # the default spool: under the shared checkpoint volume
    assert config.stream.checkpoint_location == checkpoint_mount.split(":")[1]
