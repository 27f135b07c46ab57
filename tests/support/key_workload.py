"""A random insert/update/delete workload on one keyed table, and the checks of what a sink got from it.

Used by the stream app's fault tests (tests/integration/spark/test_stream_app.py) and the Postgres version matrix.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg


class KeyWorkload:
    """Random transactions on ``table (id int PRIMARY KEY, v int)`` from a thread; records what committed,
    per key, in commit order. ``state`` starts from the rows already in the table (``{id: v}``)."""

    def __init__(
        self, dsn: str, keys: int = 200, seed: int = 7, state: dict[int, int] | None = None, table: str = "kv"
    ) -> None:
        self.dsn = dsn
        self.table = table
        self.keys = keys
        self.rng = random.Random(seed)
        self.expected: dict[int, list[tuple[str, int | None]]] = {}
        self.state: dict[int, int] = dict(state or {})
        self.committed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as conn:
                while not self._stop.is_set():
                    ops: list[tuple[int, str, int | None]] = []
                    state = dict(self.state)
                    for _ in range(self.rng.randint(1, 20)):
                        key = self.rng.randrange(self.keys)
                        if key not in state:
                            state[key] = 0
                            conn.execute(f"INSERT INTO {self.table} VALUES (%s, 0)", (key,))
                            ops.append((key, "insert", 0))
                        elif self.rng.random() < 0.15:
                            del state[key]
                            conn.execute(f"DELETE FROM {self.table} WHERE id = %s", (key,))
                            ops.append((key, "delete", None))
                        else:
                            state[key] += 1
                            conn.execute(f"UPDATE {self.table} SET v = %s WHERE id = %s", (state[key], key))
                            ops.append((key, "update", state[key]))
                    conn.commit()
                    self.state = state
                    for key, action, value in ops:
                        self.expected.setdefault(key, []).append((action, value))
                        self.committed += 1
                    time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def start(self) -> KeyWorkload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error:
            raise self.error


def check_against_workload(messages: list[dict[str, Any]], workload: KeyWorkload) -> None:
    """Nothing lost, nothing duplicated, per key exactly the committed sequence in order."""
    keys = [m["metadata"]["idempotency_key"] for m in messages]
    assert len(keys) == len(set(keys)), "duplicate messages in the sink"
    got: dict[int, list[tuple[str, int | None]]] = {}
    for m in messages:  # position order
        got.setdefault(m["record"]["id"], []).append((m["action"], m["record"].get("v")))
    assert got == workload.expected
    assert len(messages) == workload.committed


def replay(messages: list[dict[str, Any]]) -> tuple[dict[Any, dict[str, Any]], list[tuple[Any, Any, Any]]]:
    """Replay a sink's messages (changes and backfill reads, in position order) into the rows they say
    exist, keyed by ``id``; also return the stale reads: a read that disagrees with a change before it."""
    state: dict[Any, dict[str, Any] | None] = {}
    changed: set[Any] = set()
    stale: list[tuple[Any, Any, Any]] = []
    for m in messages:
        key = m["record"]["id"]
        if m["action"] == "read":
            if key in changed and state.get(key) != m["record"]:
                stale.append((key, state.get(key), m["record"]))
            state[key] = m["record"]
        else:
            changed.add(key)
            state[key] = None if m["action"] == "delete" else m["record"]
    return {k: v for k, v in state.items() if v is not None}, stale
