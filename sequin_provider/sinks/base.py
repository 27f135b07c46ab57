"""The interface every destination implements (one module per destination kind, ``sinks.registry``).

A destination kind is either *stored*: its messages become durable rows of the store's stream
table, which consumers pull (the Sequin Stream), or *pushed*: the Spark executors deliver its
messages a group at a time, in position order within a group, and park what fails in the buffer
for ``retry`` (the webhook). A kind declares which, parses and validates its own ``destination:``
options into a typed, frozen dataclass (errors name the key path, as the rest of the config), says
how the buffer redelivers a parked message (``retry``), and what ``sequin status`` and the Airflow
view show for a sink of it (``counts``).

A stored kind makes the executor-side ``StoredSinkWriter`` (``sinks.stored``, ``writer``) that turns a
sink's rendered messages of a partition into COPY binary tuples of the stream table: its database's
stored sinks share one COPY per partition (``StreamTableWriter``), the messages of a failed transform
and those behind parked groups are parked before the batch completes, and the driver then makes the
batch visible to consumers. A pushed kind makes the executor-side ``PushSink`` (``sinks.push``,
``pusher``) that sends its messages. The Spark glue (``spark.pipeline``) only partitions, renders and
reports; it asks the kind which of the two it is and for its writer or pusher.

This module imports nothing of the pipeline, so the config parser can ask the registry without
import cycles; the kind modules import what their work needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol

if TYPE_CHECKING:
    import psycopg

    from sequin_provider.buffer import Render, RetryReport
    from sequin_provider.config import SequinConfig, SinkConfig
    from sequin_provider.delivery import Outgoing
    from sequin_provider.exceptions import ConfigError
    from sequin_provider.sinks.changelog import ChangelogSelection
    from sequin_provider.sinks.push import PushSink
    from sequin_provider.sinks.sequin_stream import SequinStreamSink
    from sequin_provider.sinks.stored import StoredSinkWriter, StreamTableWriter


class OptionReader(Protocol):
    """What a kind's option parser gets from the config parser: typed values from the YAML tree,
    or a ``ConfigError`` naming the file, the key path and the reason."""

    def fail(self, path: str, reason: str) -> ConfigError:
        """The error for a bad value at ``path`` (raise it)."""

    def mapping(self, value: Any, path: str, allowed: set[str], required: set[str] = ...) -> dict[str, Any]:
        """``value`` as a mapping with only ``allowed`` keys and every ``required`` one."""

    def string(self, value: Any, path: str) -> str:
        """A non-empty string, ``${VAR}`` substituted."""

    def boolean(self, value: Any, path: str) -> bool:
        """``true`` or ``false``."""

    def integer(self, value: Any, path: str, minimum: int = 0, maximum: int | None = None) -> int:
        """An integer within bounds."""

    def duration(self, value: Any, path: str) -> float:
        """Seconds from ``15``, ``"15s"``, ``"500ms"``, ``"2m"``."""

    def connection(self, value: dict[str, Any], path: str) -> tuple[str | None, str | None]:
        """``(dsn, conn_id)`` of a mapping's ``dsn:`` or ``conn_id:`` (an Airflow connection, resolved
        as the databases' and the store's are); ``(None, None)`` if it has neither."""


class DestinationKind(ABC):
    """One kind of destination (``destination.type``): how its options are read, whether it is
    stored or pushed, how parked messages are redelivered, and what its sinks report."""

    name: ClassVar[str]
    """The ``destination.type`` that selects this kind."""
    stored: ClassVar[bool]
    """True: messages are durable rows of the store's stream table, pulled by consumers (the
    Sequin Stream API serves them), written by the executors' COPY (``writer``). False: pushed from
    the executors (``pusher``)."""

    batched: ClassVar[bool] = False
    """True (a kind that is not stored): the driver hands the kind a sink's messages of each
    micro-batch at once, in position order, after the batch's rows are known (``commit_batch``),
    instead of the executors pushing them a request at a time: for a destination that takes a
    batch as one transaction (Iceberg: one commit per micro-batch and table)."""

    @property
    def pushed(self) -> bool:
        """Whether the executors deliver this kind's messages (``pusher``), parking failures."""
        return not self.stored and not self.batched

    def option_keys(
        self,
        reader: OptionReader,
        value: Mapping[str, Any],
        path: str,
        allowed: set[str],
        required: set[str] = frozenset(),
    ) -> dict[str, Any]:
        """``value`` (the ``destination:`` mapping) checked for this kind's keys (and ``type``)."""
        return reader.mapping(dict(value), path, {"type", *allowed}, set(required))

    @abstractmethod
    def parse_options(self, reader: OptionReader, value: Mapping[str, Any], path: str) -> Any:
        """This kind's typed options (a frozen dataclass) from the ``destination:`` mapping at
        ``path``; a bad key or value raises ``reader.fail(<path>.<key>, reason)``."""

    def retry(self, config: SequinConfig, sink: SinkConfig, render: Render, workers: int) -> RetryReport:
        """Redeliver the sink's due parked messages (``buffer.retry_sink`` with this kind's delivery).
        A pushed kind's default: each message sent again on its own through a fresh ``pusher``,
        ``workers`` groups at a time (``sinks.push.retry_through_pusher``); a stored kind says how."""
        from sequin_provider.sinks.push import retry_through_pusher

        return retry_through_pusher(self.pusher(sink), config, sink, render, workers)

    def counts(self, conn: psycopg.Connection[Any], schema: str, sink: str) -> dict[str, int]:
        """Message counts of a sink of this kind for ``sequin status`` and the Airflow view (the
        buffer's parked/discarded counts are every kind's and shown besides). None by default."""
        return {}

    def prepare(self, sink: SinkConfig) -> list[str]:
        """Check (and, where its options say so, create) the destination of ``sink`` at ``sequin
        init`` and the stream app's start; returns what it created, for the report. Raises
        ``exceptions.DestinationError`` (naming the sink) when it cannot be used. Nothing by default."""
        return []

    def prepare_from_source(self, sink: SinkConfig, source: psycopg.Connection[Any]) -> list[str]:
        """``prepare`` for ``sequin init``, which also hands over a connection to the sink's source
        database (autocommit), for a kind that needs its catalog (a table mirror creating its target
        from the source's columns). By default: ``prepare(sink)``."""
        return self.prepare(sink)

    def health(self, sink: SinkConfig) -> str | None:
        """One line on the destination of ``sink`` for ``sequin status`` and the Airflow view
        (reachable, its stream/exchange/table present: ``"ok"`` or what is wrong), within a few
        seconds; None when the kind has nothing to check (the default)."""
        return None

    def keeps_changelog(self, sink: SinkConfig) -> bool:
        """Whether ``sink`` keeps a changelog (``sinks.changelog``) that ``sequin replay`` reads
        (``changelog_rows``). No by default."""
        return False

    def changelog_rows(
        self, config: SequinConfig, sink: SinkConfig, selection: ChangelogSelection
    ) -> list[tuple[Any, ...]]:
        """A changelog sink's rows of ``selection`` in position order (``sinks.changelog.select_changes``'s
        columns); ``ReplayError`` when they cannot be read."""
        raise TypeError(f"destination type {self.name!r} keeps no changelog")

    def replay_refusal(self, sink: SinkConfig) -> str | None:
        """Why ``sink`` cannot take a replay of old changes (``sequin replay``), or None (the default)."""
        return None

    def commit_batch(
        self, config: SequinConfig, sink: SinkConfig, messages: Outgoing, store: SequinStreamSink
    ) -> tuple[int, int]:
        """A batched kind (``batched``): write ``messages``, the sink's messages of one micro-batch in
        position order, durably before returning, parking in the buffer what it refuses (through
        ``store``, the driver's store connection); returns (delivered, parked). Raising fails the batch (Spark replays it), so a
        kind must make a replayed batch a no-op. Called by the driver once per micro-batch and sink."""
        raise TypeError(f"destination type {self.name!r} is not batched")

    def pusher(self, sink: SinkConfig) -> PushSink:
        """The executor-side sender of a pushed sink's messages (``sinks.push.PushSink``)."""
        raise TypeError(f"destination type {self.name!r} is stored, not pushed")

    def writer(self, sink: SinkConfig, table: StreamTableWriter) -> StoredSinkWriter:
        """The executor-side writer of a stored sink's messages into ``table``'s COPY of the
        stream table (``sinks.stored.StoredSinkWriter``)."""
        raise TypeError(f"destination type {self.name!r} is pushed, not stored")
