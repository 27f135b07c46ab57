"""``make up``: an embedded Postgres with the demo shop schema, and ``airflow standalone`` with this
provider, its DAGs and connections, ready at http://localhost:8080. Ctrl-C stops all of it.

Airflow runs with SQLite and the LocalExecutor (small parallelism) under ``var/airflow``; the DAGs
folder is ``dags/``; ``sequin_default`` and ``spark_default`` (``local[2]``) come from the environment,
so nothing is configured by hand. Log in as ``admin``; Airflow generates the password into
``var/airflow/simple_auth_manager_passwords.json.generated`` and prints it at its first start.
"""

from __future__ import annotations

import sys

import psycopg

from devtools.airflow_standalone import AirflowStandalone, airflow_env
from devtools.demo import CONFIG, SCHEMA, VAR
from devtools.embedded_postgres import EmbeddedPostgres, kept_data_dir
from sequin_provider.config import load_config
from sequin_provider.provisioning import initialize


def main() -> int:
    """Start everything, then wait for Ctrl-C."""
    VAR.mkdir(exist_ok=True)
    with EmbeddedPostgres(data_dir=kept_data_dir(VAR), use_env_dsn=False) as pg:
        dsn = pg.dsn("shop")
        with psycopg.connect(pg.dsn("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'shop'").fetchone()
        if not exists:
            dsn = pg.create_database("shop")
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('public.customers')").fetchone()[0] is None:  # type: ignore[index]
                for statement in SCHEMA:
                    conn.execute(statement)
        config_path = VAR / "sequin.yaml"
        config_path.write_text(CONFIG.format(dsn=dsn, checkpoint=VAR / "checkpoints-up"))
        report = initialize(load_config(config_path))
        print(f"up: Postgres at {dsn}; sequin init: {'; '.join(report.created) or 'already initialised'}")
        print(
            "up: starting airflow standalone (var/airflow) - http://localhost:8080, user admin, password in"
            " var/airflow/simple_auth_manager_passwords.json.generated; Ctrl-C stops everything",
            flush=True,
        )
        env = airflow_env(VAR / "airflow", dsn, config_path, database="shop", slot="sequin_demo_slot")
        airflow = AirflowStandalone(VAR / "airflow", env).start()
        try:
            return airflow.wait()
        except KeyboardInterrupt:
            print("\nup: stopping Airflow (it stops cleanly on SIGINT) ...", flush=True)
            airflow.stop()
            return 0
        finally:
            print("up: stopping Postgres", flush=True)


if __name__ == "__main__":
    sys.exit(main())
