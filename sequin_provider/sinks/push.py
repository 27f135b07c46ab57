"""Delivery of a pushed destination from the executors: in position order within each group,
groups concurrently over ``lanes``, behind what the buffer already holds, and what fails parked
before the batch completes (DESIGN §9). A pushed kind only says how one request is sent
(``PushSink.send``); the ordering and parking here are every pushed kind's."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from sequin_provider.buffer import Render, RetryReport, retry_sink
from sequin_provider.config import SequinConfig, SinkConfig
from sequin_provider.delivery import Outgoing, push_in_group_order
from sequin_provider.store import park_messages, parked_barriers, parked_heads

if TYPE_CHECKING:
    from sequin_provider.sinks.sequin_stream import SequinStreamSink

log = logging.getLogger(__name__)


def retry_through_pusher(
    pusher: PushSink, config: SequinConfig, sink: SinkConfig, render: Render, workers: int
) -> RetryReport:
    """Redeliver a pushed sink's due parked messages through ``pusher``, one message per request
    with its idempotency key (``buffer.retry_sink``), and close it."""
    try:
        return retry_sink(config, sink, lambda m, data: pusher.send([data], [m.idempotency_key]), render, workers)
    finally:
        pusher.close()


class PushSink(ABC):
    """The executor-side sender of one pushed sink's messages."""

    sink: str
    """The sink's name."""
    batch_size: int = 1
    """Messages per ``send`` at most."""
    lanes: int = 1
    """Groups sent concurrently at most."""
    _lane_threads: ThreadPoolExecutor | None = None

    @abstractmethod
    def send(self, messages: list[str], keys: list[str]) -> None:
        """Deliver ``messages`` (rendered JSON, in order) as one request; ``DeliveryError`` unless
        the destination took all of them. ``keys`` are their idempotency keys (the same order,
        identical on every replay: ``"<commit_lsn>:<commit_idx>"``, a backfill read's
        ``backfill:<id>:[<pk>]``), for a destination that can drop what it already has."""

    def close(self) -> None:
        """Release connections (the default holds none)."""

    def lane_threads(self) -> ThreadPoolExecutor | None:
        """The threads that send the lanes, started at the first batch and kept for the next ones (a
        pool per batch cost 0.9 ms of CPU for 16 lanes against 0.17 ms kept: the stream's driver
        delivers every micro-batch, 20 a second at a steady rate); None for a single lane. Idle
        threads end with the process (``concurrent.futures`` joins them at exit)."""
        if self.lanes <= 1:
            return None
        if self._lane_threads is None:
            self._lane_threads = ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix=f"push-{self.sink}")
        return self._lane_threads

    def deliver(self, messages: Outgoing, store: SequinStreamSink, schema: str) -> tuple[int, int]:
        """Send ``messages`` (position order) in order per group, behind the groups and truncates
        the buffer holds, and park what fails in the buffer (durable when this returns);
        returns (delivered, parked)."""
        if not messages:
            return 0, 0
        name = self.sink
        groups = set(messages.group_id)
        heads = store.retrying(lambda conn: parked_heads(conn, schema, name, groups))
        barriers = set(messages.barriers.values())
        barred, held = store.retrying(lambda conn: parked_barriers(conn, schema, name, barriers))
        result = push_in_group_order(
            name, messages, self.send, self.batch_size, self.lanes, heads, barred, held, self.lane_threads()
        )
        if result.parked:
            store.retrying(lambda conn: park_messages(conn, schema, result.parked))
            log.warning(
                "sink %s: %d messages parked in the buffer, first error: %s",
                name,
                len(result.parked),
                result.parked[0].error,
            )
        return result.delivered, len(result.parked)
