"""The Sequin operators under one import path, like ``hooks.sequin``, ``sensors.sequin`` and ``triggers.sequin``."""

from __future__ import annotations

from sequin_provider.operators.backfill import SequinBackfillOperator
from sequin_provider.operators.backfill_server import SequinBackfillServerOperator
from sequin_provider.operators.buffer import SequinBufferRetryOperator
from sequin_provider.operators.freshness import SequinFreshnessOperator
from sequin_provider.operators.replay import SequinReplayOperator
from sequin_provider.operators.replication import SequinReplicationOperator

__all__ = [
    "SequinBackfillOperator",
    "SequinBackfillServerOperator",
    "SequinBufferRetryOperator",
    "SequinFreshnessOperator",
    "SequinReplayOperator",
    "SequinReplicationOperator",
]
