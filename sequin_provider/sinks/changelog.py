"""A changelog: a table that keeps every message of a sink as a row (change retention, docs/replays.md).

Two sinks keep one: ``postgres_table`` with ``mode: changelog`` and ``iceberg`` with ``mode: changelog``.
Both have the same columns (``CHANGELOG_COLUMNS``): the message's position (``commit_lsn``,
``commit_idx``, unique per message, so a replayed batch adds nothing), what happened (``action``,
``table_schema``, ``table_name``, ``commit_timestamp``, ``record_pks``, ``idempotency_key``) and the
message's ``record`` and ``changes`` as its own JSON text. A ``retention`` period drops the rows whose
commit is older (``Retention``). ``replay`` reads a changelog back into any sink.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

CHANGELOG_COLUMNS = (
    "commit_lsn",
    "commit_idx",
    "action",
    "idempotency_key",
    "table_schema",
    "table_name",
    "commit_timestamp",
    "record_pks",
    "record",
    "changes",
)
"""A changelog table's columns: the position, what happened, and ``record``/``changes`` as JSON text."""

PRUNE_EVERY = 60.0
"""Seconds between two prunes of one changelog by one process (a prune is one indexed delete)."""


@dataclass
class Retention:
    """When a changelog's writer prunes it: rows whose ``commit_timestamp`` is older than ``seconds``
    go, at most once every ``PRUNE_EVERY`` seconds (or a tenth of the period, if shorter) per writer.
    ``seconds`` None keeps everything."""

    seconds: float | None
    _last: float = field(default=float("-inf"), repr=False)

    def due(self) -> bool:
        """Whether a prune is due now (and, if so, the clock restarts)."""
        if self.seconds is None:
            return False
        now = time.monotonic()
        if now - self._last < min(PRUNE_EVERY, self.seconds / 10):
            return False
        self._last = now
        return True
