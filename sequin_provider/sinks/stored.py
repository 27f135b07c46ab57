"""Writing a stored destination's messages from the executors (DESIGN §9): every stored sink of a
database goes into one COPY of the store's stream table per partition, streamed while the partition
renders (``StreamTableWriter``); each sink's share of it is its messages as COPY binary tuples
(``StoredSinkWriter``, which a stored kind makes: ``DestinationKind.writer``). A message whose
transform raises is parked in the buffer, and so are the later messages of its group and of groups
parked before (a transform or a filter failed), durable before the batch completes. The holding and
parking here are every stored kind's; the Spark glue (``spark.pipeline``) only feeds it rendered rows.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import pyarrow.compute as pc

from sequin_provider.buffer import FOLLOWER_ERROR
from sequin_provider.config import SinkConfig
from sequin_provider.delivery import load_transform
from sequin_provider.message_render import (
    COPY_BINARY_HEADER,
    COPY_BINARY_TRAILER,
    RenderedRows,
    copy_binary_tuple,
    outgoing,
    stream_rows_copy_binary,
)
from sequin_provider.messages import MessageTemplate
from sequin_provider.store import ParkRow, message_template_ids, park_messages, parked_heads, sinks_with_parked

if TYPE_CHECKING:
    from sequin_provider.sinks.sequin_stream import SequinStreamSink
    from sequin_provider.store import CopyChunk, Span

log = logging.getLogger(__name__)


def complete_rows(rows: RenderedRows) -> int:
    """How many of ``rows`` become stream rows (``stream_rows_copy_binary`` leaves out those with a
    null group, key or message)."""
    columns = (rows.group_id, rows.idempotency_key, rows.data)
    if not any(c.null_count for c in columns):
        return len(rows)
    valid = pc.and_(pc.and_(pc.is_valid(columns[0]), pc.is_valid(columns[1])), pc.is_valid(columns[2]))
    return int(pc.sum(valid).as_py() or 0)


class StoredSinkWriter:
    """One stored sink's messages of a partition as COPY binary tuples of the stream table, for its
    database's ``StreamTableWriter``. A sink without a transform and with nothing parked keeps the
    vectorized path (one compiled pass over the Arrow columns, no Python per message)."""

    def __init__(self, sink: SinkConfig, table: StreamTableWriter) -> None:
        self.sink = sink
        self.name = sink.name
        self.table = table
        self.transform = load_transform(sink.transform)

    @property
    def compact(self) -> bool:
        """Whether the rows of the current ``write`` may be rendered compact (``message_render.render``):
        the sink's messages go to the store as rendered (no transform, nothing parked)."""
        return self.transform is None and self.name not in self.table.held

    def tuples(self, rows: RenderedRows) -> Iterator[bytes | memoryview]:
        """The sink's COPY binary tuples of ``rows`` (position order; compact rows only when
        ``compact``). Messages whose transform raises, and later messages of their groups or of
        groups parked before, are set aside for ``StreamTableWriter.write`` to park."""
        held = self.name in self.table.held
        if self.transform is None and not held:
            ids = self.table.template_ids(rows.compact.templates) if rows.compact is not None else ()
            tuples = stream_rows_copy_binary(self.name, rows, ids)
            self.table.count(self.name, complete_rows(rows))
            if tuples.size:
                yield memoryview(tuples)
            return
        if rows.compact is not None:
            raise ValueError(f"sink {self.name}: compact rows for a sink whose messages are transformed or held")
        messages = outgoing(rows, self.sink, self.transform)
        heads = self.table.parked_heads(self.name, set(messages.group_id)) if held else {}
        blocked: set[str] = set()
        out = []
        for j, group in enumerate(messages.group_id):
            if group in blocked or (group in heads and (messages.commit_lsn[j], messages.commit_idx[j]) > heads[group]):
                self.table.parked.append(messages.park_row(self.name, j, 0, FOLLOWER_ERROR))
            elif j in messages.failed:
                self.table.parked.append(messages.park_row(self.name, j, 1, messages.failed[j][1]))
                blocked.add(group)
            else:
                out.append(
                    copy_binary_tuple(
                        (
                            self.name,
                            messages.commit_lsn[j],
                            messages.commit_idx[j],
                            group,
                            messages.idempotency_key[j],
                            messages.data[j],
                            messages.barriers.get(j),
                        )
                    )
                )
        self.table.count(self.name, len(out))
        if out:
            yield b"".join(out)


class StreamTableWriter:
    """Executor side: the stored sinks of a database written to the store's stream table, one
    COPY per partition (``write``). ``store`` takes the COPY; ``buffer``, a second connection,
    answers the buffer's questions while the COPY streams and parks what was set aside."""

    def __init__(
        self, sinks: Sequence[SinkConfig], schema: str, store: SequinStreamSink, buffer: SequinStreamSink
    ) -> None:
        self.schema = schema
        self.store = store
        self.buffer = buffer
        self.writers = {s.name: s.destination.kind.writer(s, self) for s in sinks}
        self.held: set[str] = set()
        """The sinks with parked messages, asked once per ``write``."""
        self.parked: list[ParkRow] = []
        """The messages of the current ``write`` set aside to be parked."""
        self.counts: dict[str, int] = {}
        """Per sink, the messages the current ``write`` put into the COPY (for the metrics; a replayed
        batch's messages already stored are counted too)."""
        self.templates: dict[tuple[MessageTemplate | None, ...], list[int]] = {}
        """The store's ids of the templates compact rows of the current ``write`` name."""

    def count(self, sink: str, n: int) -> None:
        """Add ``n`` messages of ``sink`` put into the current ``write``'s COPY."""
        self.counts[sink] = self.counts.get(sink, 0) + n

    def template_ids(self, templates: tuple[MessageTemplate | None, ...]) -> list[int]:
        """The store's ids of a sink's ``templates`` (``store.message_template_ids``), asked once per
        ``write`` and sink rendering, on the buffer connection: committed before the COPY is."""
        if templates not in self.templates:
            wanted = [t for t in templates if t is not None]
            if len(wanted) != len(templates):
                raise ValueError("compact rows of a table without a template")
            self.templates[templates] = self.buffer.retrying(
                lambda conn: message_template_ids(conn, self.schema, wanted)
            )
        return self.templates[templates]

    def parked_counts(self) -> dict[str, int]:
        """Per sink, the messages the last ``write`` parked."""
        out: dict[str, int] = {}
        for row in self.parked:
            out[row.sink] = out.get(row.sink, 0) + 1
        return out

    def writer(self, sink: str) -> StoredSinkWriter:
        """The writer of stored sink ``sink``."""
        return self.writers[sink]

    def parked_heads(self, sink: str, groups: set[str]) -> dict[str, tuple[int, int]]:
        """The first parked position of each of the sink's ``groups`` that has one (``buffer.parked_heads``)."""
        return self.buffer.retrying(lambda conn: parked_heads(conn, self.schema, sink, groups))

    def write(self, payload: Iterable[CopyChunk], span: Span) -> int:
        """Durably write one partition: ``payload``, the sinks' ``StoredSinkWriter.tuples`` produced
        as the COPY consumes them, in one COPY binary stream (``SequinStreamSink.write``; ``span``
        bounds its positions); then park what was set aside, durable before the batch completes
        (the slot may then pass them). Returns how many rows were new."""
        self.parked = []
        self.counts = {}
        self.templates = {}
        # a sink with nothing parked keeps the vectorized path; what it costs: one round trip per
        # task and batch (sinks_with_parked: 2.3 ms measured on a 2-core machine at load 15)
        names = list(self.writers)
        self.held = self.buffer.retrying(lambda conn: sinks_with_parked(conn, self.schema, names))
        written = self.store.write(
            itertools.chain((COPY_BINARY_HEADER,), payload, (COPY_BINARY_TRAILER,)), binary=True, span=span
        )
        if self.parked:
            parked = self.parked
            self.buffer.retrying(lambda conn: park_messages(conn, self.schema, parked))
            log.warning(
                "%d messages parked in the buffer (a transform raised, or behind a parked message): %s",
                len(parked),
                parked[0].error,
            )
        return written
