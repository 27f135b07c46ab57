"""``airflow standalone`` with this provider, its DAGs and connections, and a small client of
Airflow's REST API to drive it: ``make up`` runs it for people, the Airflow part of ``make demo``
and the end-to-end test trigger DAG runs through it as a user's scripts would.

Airflow runs with the LocalExecutor (small parallelism) under ``home``, its metadata in a Postgres
database when given one (``airflow_env(metadata_dsn=...)``: the end-to-end test and the demo), else
in SQLite there (``make up``); the DAGs folder
is ``dags/``; ``sequin_default`` and ``spark_default`` (``local[2]``) come from the environment, so
nothing is configured by hand. The user is ``admin``; Airflow generates the password into
``<home>/simple_auth_manager_passwords.json.generated`` at its first start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import httpx
import psycopg

from devtools.sqlalchemy_url import sqlalchemy_url
from devtools.stream_process import ROOT, wait_for

TERMINAL_RUN_STATES = frozenset({"success", "failed"})


def airflow_env(
    home: Path,
    dsn: str,
    config_path: Path,
    *,
    port: int = 8080,
    database: str | None = None,
    slot: str | None = None,
    metadata_dsn: str | None = None,
) -> dict[str, str]:
    """The environment of ``airflow standalone`` and of every process it starts (tasks included).

    ``metadata_dsn``: a Postgres database for Airflow's own metadata, as in production; ``None``
    keeps Airflow's SQLite file under ``home``. SQLite takes one writer at a time, and a writer that
    waits more than 5 s fails: on a loaded machine that can fail a task's success (the API server
    marks a task failed when its state update raises), so the end-to-end runs use Postgres.
    """
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    venv_bin = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYSPARK_PYTHON": sys.executable,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://localhost:{port}/execution/",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW_CONN_SEQUIN_DEFAULT": json.dumps(
            {
                "conn_type": "sequin",
                "host": params.get("host"),
                "port": int(params.get("port") or 5432),
                "login": params.get("user"),
                "password": params.get("password"),
                "schema": params.get("dbname"),
                "extra": {"config_path": str(config_path)},
            }
        ),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "SEQUIN_CONFIG": str(config_path),
    }
    if metadata_dsn:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sqlalchemy_url(metadata_dsn)
    if database:
        env["SEQUIN_DATABASE"] = database
    if slot:
        env["SEQUIN_SLOT"] = slot
    return env


class AirflowApiError(RuntimeError):
    """Airflow's REST API answered with an error status."""


class AirflowStandalone:
    """``airflow standalone`` as a child process (its own process group), and a REST client for it.

    :param home: ``AIRFLOW_HOME`` (logs, the generated admin password, the SQLite database if no other).
    :param env: the processes' environment, usually from ``airflow_env``.
    :param port: the API server's port (UI and REST API).
    :param log_path: where Airflow's output goes; ``None`` leaves it on this process's terminal.
    """

    def __init__(self, home: Path, env: dict[str, str], *, port: int = 8080, log_path: Path | None = None) -> None:
        self.home = home
        self.env = env
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._token: str | None = None

    # -- the process -------------------------------------------------------------------------------

    def start(self) -> AirflowStandalone:
        """Start ``airflow standalone`` (it migrates its database on first use)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["airflow", "standalone"],
            env=self.env,
            start_new_session=True,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
        )
        return self

    def check_alive(self) -> None:
        """Raise with the log tail when Airflow has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of Airflow's output (when it goes to a file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def task_logs(self, dag_id: str, run_id: str, chars: int = 6000) -> str:
        """The end of each task log of a run, as Airflow wrote them under ``<home>/logs`` (for a
        failure message: Airflow's own output does not hold what a task printed)."""
        run_dir = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        parts = [
            f"--- {path.relative_to(run_dir)} ---\n{path.read_text(errors='replace')[-chars:]}"
            for path in sorted(run_dir.glob("task_id=*/**/*.log"))
        ]
        return "\n".join(parts) or f"(no task log under {run_dir})"

    def wait(self) -> int:
        """Wait for Airflow to exit; its exit code."""
        assert self.proc is not None, "not started"
        return self.proc.wait()

    def stop(self, timeout: float = 90.0) -> int | None:
        """Stop every component (SIGINT, as Ctrl-C would; SIGKILL to the group after ``timeout``)."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                try:  # SIGINT to standalone alone: it stops its components itself, in order
                    self.proc.send_signal(signal.SIGINT)
                    code = self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    code = self.proc.wait()
                except ProcessLookupError:
                    code = self.proc.wait()
            else:
                code = self.proc.returncode
            try:  # components it started that outlived it (a task's spark-submit, say)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> AirflowStandalone:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the REST API ------------------------------------------------------------------------------

    def health(self) -> dict[str, Any] | None:
        """``/api/v2/monitor/health``, or ``None`` while the API server does not answer."""
        try:
            response = httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=10)
        except httpx.HTTPError:
            return None
        return response.json() if response.is_success else None  # type: ignore[no-any-return]

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait until the metadata database, scheduler, triggerer and DAG processor report healthy, then log in."""
        components = ("metadatabase", "scheduler", "triggerer", "dag_processor")

        def ready() -> bool:
            self.check_alive()
            health = self.health() or {}
            return all((health.get(name) or {}).get("status") == "healthy" for name in components)

        wait_for(ready, timeout, interval=2, what="airflow standalone to be healthy")
        self.login()

    def admin_password(self) -> str:
        """The generated password of ``admin``."""
        path = self.home / "simple_auth_manager_passwords.json.generated"
        return str(json.loads(path.read_text())["admin"])

    def login(self) -> None:
        """Get an API token for ``admin`` (``POST /auth/token``)."""
        response = httpx.post(
            f"{self.base_url}/auth/token", json={"username": "admin", "password": self.admin_password()}, timeout=30
        )
        if not response.is_success:
            raise AirflowApiError(f"login failed: HTTP {response.status_code}: {response.text[:500]}")
        self._token = response.json()["access_token"]

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call ``/api/v2{path}`` as admin; the JSON answer, or ``AirflowApiError`` with Airflow's detail."""
        if self._token is None:
            self.login()
        response = httpx.request(
            method,
            f"{self.base_url}/api/v2{path}",
            timeout=60,
            headers={"Authorization": f"Bearer {self._token}"},
            **kwargs,
        )
        if not response.is_success:
            raise AirflowApiError(f"{method} {path}: HTTP {response.status_code}: {response.text[:1000]}")
        return response.json() if response.content else None

    def wait_dag(self, dag_id: str, timeout: float = 300.0) -> dict[str, Any]:
        """Wait until the DAG processor has parsed ``dag_id``; its details."""

        def parsed() -> dict[str, Any] | None:
            self.check_alive()
            try:
                return self.request("GET", f"/dags/{dag_id}")  # type: ignore[no-any-return]
            except AirflowApiError as exc:
                if "HTTP 404" in str(exc):
                    return None
                raise

        return wait_for(parsed, timeout, interval=2, what=f"DAG {dag_id} to be parsed")

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """Trigger a run of ``dag_id`` with ``conf`` and unpause the DAG so it runs; the run id.
        (For an ``@continuous`` DAG use ``start_continuous``.)"""
        self.wait_dag(dag_id)
        run = self.request("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        self.set_paused(dag_id, False)
        return str(run["dag_run_id"])

    def set_paused(self, dag_id: str, paused: bool) -> None:
        """Pause or unpause ``dag_id``."""
        self.request("PATCH", f"/dags/{dag_id}", json={"is_paused": paused})

    def start_continuous(self, dag_id: str, timeout: float = 300.0) -> str:
        """Unpause an ``@continuous`` DAG and return the run the scheduler starts for it (a manual
        trigger would only queue behind that run)."""
        self.wait_dag(dag_id)
        self.set_paused(dag_id, False)

        def started() -> str | None:
            self.check_alive()
            runs = self.request("GET", f"/dags/{dag_id}/dagRuns", params={"state": ["queued", "running"]})
            return str(runs["dag_runs"][0]["dag_run_id"]) if runs["dag_runs"] else None

        return wait_for(started, timeout, interval=1, what=f"the scheduler to start a run of {dag_id}")  # type: ignore[no-any-return]

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """The DAG run."""
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}")  # type: ignore[no-any-return]

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        """The run's task instances by task id."""
        answer = self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return {ti["task_id"]: ti for ti in answer["task_instances"]}

    def wait_run(
        self, dag_id: str, run_id: str, timeout: float = 900.0, states: frozenset[str] = TERMINAL_RUN_STATES
    ) -> dict[str, Any]:
        """Wait until the run reaches one of ``states``; the run."""

        def reached() -> dict[str, Any] | None:
            self.check_alive()
            run = self.run(dag_id, run_id)
            return run if run["state"] in states else None

        return wait_for(reached, timeout, interval=2, what=f"run {run_id} of {dag_id} to reach {sorted(states)}")

    def wait_task(
        self, dag_id: str, run_id: str, task_id: str, states: frozenset[str], timeout: float = 600.0
    ) -> dict[str, Any]:
        """Wait until a task instance reaches one of ``states``; the task instance."""

        def reached() -> dict[str, Any] | None:
            self.check_alive()
            ti = self.task_instances(dag_id, run_id).get(task_id)
            return ti if ti and ti["state"] in states else None

        return wait_for(reached, timeout, interval=2, what=f"task {task_id} of {dag_id} to reach {sorted(states)}")

    def set_run_state(self, dag_id: str, run_id: str, state: str) -> dict[str, Any]:
        """Mark the run ``success`` / ``failed`` / ``queued``; running tasks of an ended run are stopped."""
        return self.request("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": state})  # type: ignore[no-any-return]
