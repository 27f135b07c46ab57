"""Airflow-side helpers of the tests: connections, a notification webhook, the supervisor's traces."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil
import psycopg
from psycopg.conninfo import conninfo_to_dict

from devtools.stream_process import wait_for
from sequin_provider.operators.replication import lock_name

# The triggers' connection id and a poll interval short enough for tests.
FAST_TRIGGER = {"sequin_conn_id": "sequin_trig", "poke_interval": 0.05}


def sequin_connection(dsn: str, **extra: Any) -> str:
    """``AIRFLOW_CONN_<ID>`` (JSON form) of a ``sequin`` connection to ``dsn``."""
    parts = conninfo_to_dict(dsn)
    return json.dumps(
        {
            "conn_type": "sequin",
            "host": parts.get("host"),
            "port": int(parts.get("port") or 5432),
            "login": parts.get("user"),
            "password": parts.get("password"),
            "schema": parts.get("dbname"),
            "extra": extra,
        }
    )


class Webhook:
    """A local webhook on 127.0.0.1 (random port): records what it receives; ``/fail`` answers 500."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append({"path": self.path, "headers": dict(self.headers), "json": json.loads(body)})
                status = 500 if self.path.startswith("/fail") else 204
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def group_gone(pgid: int | None) -> bool:
    """No live process is left in the process group (zombies awaiting their reaper do not count)."""
    if pgid is None:
        return True
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return False
        except (ProcessLookupError, psutil.Error):
            continue
    return True


def no_process_left(pgid: int | None) -> bool:
    """Wait (bounded) until a killed process group has died: SIGKILL is delivered at once but a
    process takes a moment to exit."""
    wait_for(lambda: group_gone(pgid), 60, interval=0.1, what=f"process group {pgid} to exit")
    return True


def lock_is_free(dsn: str) -> bool:
    """Whether the replication supervisor's lock (schema ``sequin``) is free: taken and released at once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (lock_name("sequin", "app"),)).fetchone()[0]
        return bool(got)  # released with this session


class OperatorThread:
    """An operator's ``execute`` in a thread of the test, as it would run in a worker: its result or
    the exception it raised (``outcome["result"]`` / ``outcome["error"]``) once it returns."""

    def __init__(self, operator: Any) -> None:
        self.operator = operator
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, name=f"operator-{operator.task_id}", daemon=True)

    def _run(self) -> None:
        try:
            self.outcome["result"] = self.operator.execute(context={})
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.outcome["error"] = exc

    def start(self) -> OperatorThread:
        self.thread.start()
        return self

    def stop(self, timeout: float = 180) -> None:
        """Stop the operator as Airflow does (``on_kill``) and wait for ``execute`` to return."""
        self.operator.on_kill()
        self.thread.join(timeout)
