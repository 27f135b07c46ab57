"""A real Spark standalone cluster on loopback: a master and workers started from pyspark's own jars
(the same daemons the docker-compose file runs in containers), for tests and benchmarks that submit
apps to ``spark://`` rather than run them in local mode.

Each worker has a work folder of its own (``worker-<n>``), where it starts the executors of every
app (``<app id>/<executor id>/stderr``): what an executor logged tells which worker ran it.

With ``hide_from_last_worker``, the last worker runs in a mount namespace of its own with an empty
tmpfs over ``<work>/hidden``: its executors do not see what the driver writes there, as if they ran on
another host (``hidden`` is None where mount namespaces are not allowed: ``unshare -m``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pyspark

from devtools.embedded_postgres import free_port
from devtools.stream_process import wait_for


class SparkCluster:
    """A Spark standalone master and ``workers`` workers (``cores`` and ``memory`` each) on 127.0.0.1."""

    def __init__(
        self, work: Path, workers: int = 1, cores: int = 2, memory: str = "2g", hide_from_last_worker: bool = False
    ) -> None:
        self.work = work
        self.workers, self.cores, self.memory = workers, cores, memory
        self.hidden: Path | None = None
        if hide_from_last_worker and mount_namespaces_allowed():
            self.hidden = work / "hidden"
            self.hidden.mkdir()
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _daemon(self, name: str, *args: str, hidden: Path | None = None) -> None:
        home = Path(pyspark.__file__).parent
        command = [str(home / "bin" / "spark-class"), *args]
        if hidden is not None:
            mount = f"mount -t tmpfs sequin-hidden {shlex.quote(str(hidden))} && exec {shlex.join(command)}"
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
        env = {
            **os.environ,
            "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(self.work / name),
            "SPARK_LOG_DIR": str(self.work),
        }
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it; closed when we exit
        self.procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def state(self) -> dict[str, Any] | None:
        """The master's JSON status page (workers, applications), or None while it does not answer
        with one (starting, its web UI has answered ``/json/`` with its HTML page)."""
        try:
            response = httpx.get(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5)
            return response.json() if response.is_success else None  # type: ignore[no-any-return]
        except (httpx.HTTPError, ValueError):
            return None

    def start(self) -> SparkCluster:
        """Start the master (``wait_ready`` starts the workers once the master answers)."""
        self._daemon(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui_port),
        )
        return self

    def wait_ready(self) -> SparkCluster:
        """Wait for the master, start the workers (a worker that finds no master retries only after
        5-15 s) and wait until all have registered."""
        wait_for(self.state, 180, interval=0.5, what="the Spark master")
        for n in range(len(self.procs), self.workers + 1):
            self._daemon(
                f"worker-{n}",
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--webui-port",
                str(free_port()),
                "--cores",
                str(self.cores),
                "--memory",
                self.memory,
                self.url,
                hidden=self.hidden if n == self.workers else None,
            )
        wait_for(
            lambda: (self.state() or {}).get("aliveworkers", 0) >= self.workers,
            180,
            interval=0.5,
            what="the Spark workers to register",
        )
        return self

    def executor_logs(self, app_id: str) -> dict[str, list[Path]]:
        """The stderr files of an app's executors, per worker (``worker-<n>``)."""
        return {
            f"worker-{n}": sorted((self.work / f"worker-{n}" / app_id).glob("*/stderr"))
            for n in range(1, self.workers + 1)
        }

    def stop(self) -> None:
        """Kill the daemons (and the executors the workers started)."""
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def mount_namespaces_allowed() -> bool:
    """Whether this process may make a mount namespace with a tmpfs in it (root, no seccomp veto)."""
    try:
        probe = subprocess.run(
            ["unshare", "--mount", "sh", "-c", "mount -t tmpfs sequin-probe /mnt"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
