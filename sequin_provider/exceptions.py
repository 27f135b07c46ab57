"""The errors of the Sequin domain: one hierarchy under ``SequinError``.

The domain modules (config, store, replication, backfills, delivery, supervision) raise these, and
know nothing of Airflow. The Airflow layer maps them to Airflow's exceptions in one place
(``sequin_provider.airflow_errors``): an error that a retry cannot fix (``retryable = False``: a bad
config, an invalid backfill request, a lock another process holds) fails the task without retries,
the others let Airflow retry.

The classes keep the names they had where they were first defined (``config.ConfigError``,
``store.BackfillError``, ``replication.ReplicationError``, ``buffer.DeliveryError``, ...), which import
them from here; several also derive from the builtin they derived from before (``ValueError``,
``RuntimeError``), so existing ``except`` clauses still catch them.
"""

from __future__ import annotations

from typing import ClassVar, Sequence


class SequinError(Exception):
    """Base of every error of the Sequin domain."""

    retryable: ClassVar[bool] = True
    """Whether trying the same thing again later may succeed (the store may be back, the app may
    start); False for errors in the request or the config, which fail the same way every time."""


class ConfigError(SequinError, ValueError):
    """An invalid configuration: ``str(err)`` is ``<file>: <key.path>: <reason>``."""

    retryable = False

    def __init__(self, source: str, path: str, reason: str) -> None:
        self.source, self.path, self.reason = source, path, reason
        super().__init__(f"{source}: {path or '<top>'}: {reason}")


class UnknownSinkError(ConfigError):
    """A sink name that the config does not have; the message lists the configured sinks."""

    def __init__(self, source: str, name: str, configured: Sequence[str]) -> None:
        self.name, self.configured = name, tuple(configured)
        super().__init__(
            source, "sinks", f"unknown sink {name!r} (configured sinks: {', '.join(configured) or 'none'})"
        )


class StoreError(SequinError):
    """The store (the Sequin schema in Postgres) failed us."""


class StoreUnavailableError(StoreError, RuntimeError):
    """The store cannot be reached (or stayed unreachable for longer than a retry budget)."""


class ReplicationError(SequinError, RuntimeError):
    """A prerequisite or slot problem of the source, with an actionable message."""


class SourceUnavailableError(ReplicationError):
    """The source database cannot be reached (or its server stopped or is stopping)."""


class BackfillError(SequinError, ValueError):
    """A backfill request or state change that is not allowed, with the reason."""

    retryable = False


class DeliveryError(SequinError, RuntimeError):
    """A sink did not take a message (its text says why: HTTP status, timeout, connection error)."""


class DestinationError(SequinError):
    """A sink's destination cannot be used as configured (unreachable, credentials refused, its
    stream/exchange/table missing with ``create`` off); raised by ``sequin init`` and the stream app's
    start, before anything is delivered. The text names the sink."""

    retryable = True

    def __init__(self, sink: str, reason: str) -> None:
        self.sink, self.reason = sink, reason
        super().__init__(f"sink {sink!r}: {reason}")


class SupervisionError(SequinError):
    """The supervised stream app could not be kept running (it kept failing, or its lock was lost)."""


class LockHeldError(SequinError):
    """Another process holds the lock this one needs (e.g. the stream app of a database is already
    supervised); retrying at once would find it held again."""

    retryable = False


class ConditionError(SequinError):
    """A watched condition that can never hold (a slot gone, a backfill failed), with what was seen."""

    def __init__(self, message: str, payload: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.payload = payload or {}


class ReplayError(SequinError, ValueError):
    """A replay of retained changes that cannot be made (its sinks, tables, range or condition), with
    the reason."""

    retryable = False
