"""spark-submit of the Sequin Spark apps through ``SparkSubmitHook``, as a process we can watch and stop.

``SparkSubmitHook.submit`` blocks until spark-submit exits and can only SIGKILL it. The operators
need more: the replication supervisor watches the store while the app runs, and both operators
stop the app on ``on_kill``. So ``SparkSubmitRun`` runs the hook in a thread, in a process group of
its own (``start_new_session``), and stops the app the way it stops cleanly: SIGTERM to the Python
driver (in client mode spark-submit's JVM runs the driver as its child; the driver's handler stops
the query and the JVM then exits with the driver's code), then, after a grace period, the hook's
own kill (which also covers YARN/Kubernetes/standalone-cluster drivers) and SIGKILL of the group.

Two details of the apps are handled here rather than in every operator: the apps set
``spark.master`` themselves when not given ``--master`` (overriding spark-submit's), so the
connection's master is also passed as an application argument; and in client mode Spark's Python
must be the interpreter that has this package (``PYSPARK_PYTHON``/``PYSPARK_DRIVER_PYTHON``).

The submitted app has no Airflow: the Airflow connections its config names (``conn_id``), which the
operator resolved through Airflow, reach it as ``AIRFLOW_CONN_<ID>`` variables (URI form) of the
spark-submit process (``connection_env``), never on its command line or in a log.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import psutil
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

from sequin_provider.config import airflow_conn_env, dsn_uri
from sequin_provider.spark.app import SUPERVISOR_PID_ENV
from sequin_provider.spark_apps import app_path

SPARK_APPS_ENV = "SEQUIN_SPARK_APPS"
"""A folder holding the app files to submit instead of the installed package's."""

log = logging.getLogger(__name__)


def default_application(name: str) -> str:
    """Path of the app file ``name`` to submit: in ``$SEQUIN_SPARK_APPS`` if set, else the one in the
    installed package (``sequin_provider/spark_apps/``), so a wheel install needs no checkout."""
    folder = os.environ.get(SPARK_APPS_ENV)
    return str(Path(folder) / name) if folder else str(app_path(name))


@dataclass(frozen=True)
class SparkTarget:
    """Where a connection submits to: the master URL and the deploy mode (None = client)."""

    master: str
    deploy_mode: str | None

    @property
    def is_cluster(self) -> bool:
        """The driver runs on the cluster, not here."""
        return self.deploy_mode == "cluster"

    @property
    def is_local(self) -> bool:
        """Spark runs inside the spark-submit JVM on this machine."""
        return self.master.startswith("local")

    @property
    def env_on_command_line(self) -> bool:
        """``SparkSubmitHook`` writes its ``env_vars`` into the command line (``--conf
        spark.yarn.appMasterEnv.*`` / ``spark.kubernetes.driverEnv.*``), as it does for YARN and
        Kubernetes masters (its own test: the master URL contains ``yarn`` / ``k8s``)."""
        return "yarn" in self.master or "k8s" in self.master


def resolve_target(conn_id: str) -> SparkTarget:
    """Master and deploy mode as ``SparkSubmitHook`` resolves them (a host of ``local[*]`` in a
    connection of type ``spark`` gives master ``local[*]``)."""
    probe = SparkSubmitHook(conn_id=conn_id)
    return SparkTarget(str(probe._connection["master"]), probe._connection.get("deploy_mode"))


def connection_env(target: SparkTarget, connections: Mapping[str, str] | None) -> dict[str, str]:
    """``AIRFLOW_CONN_<ID>`` (URI form) of each ``{conn_id: DSN}``, for the submitted app's
    environment-variable resolver. Handed only where the driver is spark-submit's child and
    ``SparkSubmitHook`` gives ``env_vars`` to that process alone (client mode, neither YARN nor
    Kubernetes); elsewhere they would land on the command line, so none are handed and a warning
    says that the driver must find them in its own environment."""
    if not connections:
        return {}
    if target.is_cluster or target.env_on_command_line:
        log.warning(
            "the config names Airflow connections (%s) but with master %s%s they are not handed to the"
            " Spark app (spark-submit would carry them on its command line): give its driver the"
            " AIRFLOW_CONN_* variables, or use dsn: ${VAR} in the config",
            ", ".join(sorted(connections)),
            target.master,
            " in cluster deploy mode" if target.is_cluster else "",
        )
        return {}
    return {airflow_conn_env(conn_id): dsn_uri(dsn) for conn_id, dsn in connections.items()}


def submit_env(
    target: SparkTarget, env_vars: dict[str, Any] | None, connections: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """spark-submit's environment: in client mode this interpreter runs the driver (and, locally,
    the executors' workers) and ``spark-submit`` is found next to it; the config's Airflow
    ``connections`` (``{conn_id: DSN}``, see ``connection_env``); ``env_vars`` override."""
    env: dict[str, str] = connection_env(target, connections)
    if not target.is_cluster:
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
        env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env[SUPERVISOR_PID_ENV] = str(os.getpid())  # the driver stops if this task's process dies
        if target.is_local:
            env["PYSPARK_PYTHON"] = sys.executable
    env.update({key: str(value) for key, value in (env_vars or {}).items()})
    return env or None


def submit_conf(target: SparkTarget, conf: Mapping[str, Any] | None) -> dict[str, Any]:
    """spark-submit's ``--conf``: the operator's ``spark_conf``, and where the driver runs here
    (client mode) the checkpoint jar this machine built first on its class path
    (``spark.local_checkpoint``: a local checkpoint without a forked ``chmod`` per file), unless
    ``spark_conf`` sets the driver's class path itself."""
    from sequin_provider.spark.local_checkpoint import driver_classpath

    merged = dict(conf or {})
    jar = driver_classpath()
    if jar and not target.is_cluster and "spark.driver.extraClassPath" not in merged:
        merged["spark.driver.extraClassPath"] = jar
    return merged


class SparkSubmitRun:
    """One spark-submit of ``application`` by ``hook``: started in a thread, watched, stopped.

    :param hook: a ``SparkSubmitHook`` built with the application's arguments.
    :param application: the ``.py`` file to submit.
    :param cwd: working directory of spark-submit (relative paths of the app resolve against it).
    """

    def __init__(self, hook: SparkSubmitHook, application: str, cwd: str | None = None) -> None:
        self.hook = hook
        self.application = application
        self.cwd = cwd
        self.error: BaseException | None = None
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.pid: int | None = None

    def start(self, timeout: float = 60.0) -> SparkSubmitRun:
        """Start spark-submit; returns once its process exists (or the submit already failed)."""
        self._thread = threading.Thread(
            target=self._submit, name=f"spark-submit {Path(self.application).name}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self.hook._submit_sp is None and not self._finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.hook._submit_sp is not None:
            self.pid = self.hook._submit_sp.pid
        return self

    def _submit(self) -> None:
        try:
            self.hook.submit(self.application, start_new_session=True, cwd=self.cwd)
        except BaseException as exc:  # noqa: BLE001 - reported through .error / .failure()
            self.error = exc
        finally:
            self._finished.set()

    @property
    def finished(self) -> bool:
        """spark-submit has exited (or could not be started)."""
        return self._finished.is_set()

    @property
    def returncode(self) -> int | None:
        """spark-submit's exit code (None while it runs or if it never started)."""
        process = self.hook._submit_sp
        return None if process is None else process.poll()

    @property
    def succeeded(self) -> bool:
        """spark-submit exited with code 0."""
        return self.finished and self.error is None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until spark-submit exits; False if ``timeout`` passed first."""
        return self._finished.wait(timeout)

    def failure(self) -> str:
        """Why the run failed, in one line: the exit code and the app's last error line."""
        code = self.returncode
        if self.error is None:
            return f"spark-submit exited with {code}"
        if code is None:
            return f"spark-submit could not run: {type(self.error).__name__}: {self.error}"
        text = str(self.error)
        head, _, tail = text.partition("Last spark-submit output:")
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        ours = [line for line in lines if " ERROR sequin." in line]
        errors = [line for line in lines if " ERROR " in line or "Error: " in line]
        fallback = head.strip().splitlines()[0] if head.strip() else type(self.error).__name__
        detail = (ours or errors or lines or [fallback])[-1]
        return f"spark-submit exited with {code}: {detail}"

    def driver_pids(self) -> list[int]:
        """The Python driver(s) of the application among spark-submit's descendants (client mode)."""
        if self.pid is None:
            return []
        name = Path(self.application).name
        found = []
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            try:
                cmdline = child.cmdline()
            except psutil.Error:
                continue
            if cmdline and "python" in Path(cmdline[0]).name and any(Path(arg).name == name for arg in cmdline[1:3]):
                found.append(child.pid)
        return found

    def stop(self, grace_period: float) -> int | None:
        """Graceful stop: SIGTERM to the Python driver (else to spark-submit), then ``kill`` after
        ``grace_period`` seconds. Returns spark-submit's exit code. A second call (``on_kill`` while
        the supervisor stops the app itself) waits for the first one instead of signalling again."""
        if self._stopping.is_set():
            self.wait(grace_period + 60)
            return self.returncode
        self._stopping.set()
        if not self.finished and self.pid is not None:
            targets = self.driver_pids() or [self.pid]
            log.info("stopping %s: SIGTERM to %s", Path(self.application).name, targets)
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            if not self.wait(grace_period):
                log.warning("%s did not stop within %.0fs: killing it", Path(self.application).name, grace_period)
        self.kill()
        return self.returncode

    def kill(self) -> None:
        """Kill now: the hook's kill (local spark-submit, cluster drivers), then every process left in
        spark-submit's process group (the Python driver, Spark's Python workers)."""
        if not self.finished:
            try:
                self.hook.on_kill()
            except Exception as exc:  # noqa: BLE001 - the group kill below still runs
                log.warning("SparkSubmitHook.on_kill failed: %s", exc)
        self._kill_group()
        self.wait(30)

    def _kill_group(self) -> None:
        if self.pid is None or self.pid == os.getpgrp():
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
