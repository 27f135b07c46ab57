"""Which spool file a micro-batch is, so that the driver can write a small batch without a Spark job.

A ``payload=spool`` micro-batch is one spool file (``spool.spool_path``) named by the batch's start
and end positions. Spark logs a batch's end offset in the checkpoint before it runs the batch
(``offsets/<batch id>``: a version line, the batch's metadata, then one JSON line per source; the
stream app has one source), and a batch starts where the one before it ended. From these two lines
the driver names the batch's spool file; ``Pipeline`` writes a small batch from there itself
(docs/architecture.md, "Small micro-batches are written by the driver"). Anything it cannot read
(a checkpoint on another file system, a batch with no batch before it in the log, a file missing)
answers None, and the batch goes through Spark's job as every batch did before.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sequin_provider.spark.source import offset_position
from sequin_provider.spark.spool import is_uri, spool_path


def logged_offset(checkpoint: str, batch_id: int) -> dict[str, Any] | None:
    """The source offset Spark logged for micro-batch ``batch_id`` in a local checkpoint, or None
    (no such entry, another file system, a format this does not know)."""
    if batch_id < 0 or is_uri(checkpoint):
        return None
    try:
        with open(os.path.join(checkpoint, "offsets", str(batch_id)), encoding="utf-8") as log_file:
            lines = log_file.read().splitlines()
    except OSError:
        return None
    if len(lines) != 3 or lines[0] != "v1":  # one source: version, metadata, its offset
        return None
    try:
        offset = json.loads(lines[2])
    except ValueError:
        return None
    return offset if isinstance(offset, dict) and "lsn" in offset else None


def batch_spool_file(checkpoint: str, spool: str, batch_id: int) -> str | None:
    """The spool file of micro-batch ``batch_id`` when it exists locally, else None."""
    start, end = logged_offset(checkpoint, batch_id - 1), logged_offset(checkpoint, batch_id)
    if start is None or end is None or is_uri(spool):
        return None
    path = spool_path(spool, offset_position(start), offset_position(end))
    return path if os.path.isfile(path) else None
