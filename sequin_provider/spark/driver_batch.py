"""Which spool file a micro-batch is, so that the driver can write a small batch without a Spark job.

A ``payload=spool`` micro-batch is one spool file (``spool.spool_path``) named by the batch's start
and end positions. Spark logs a batch's end offset in the checkpoint before it runs the batch
(``offsets/<batch id>``: a version line, the batch's metadata, then one JSON line per source; the
stream app has one source), and a batch starts where the one before it ended. From these two lines
the driver names the batch's spool file; ``Pipeline`` writes a small batch from there itself
(docs/architecture.md, "Small micro-batches are written by the driver"). Anything it cannot read
(a checkpoint or spool on another file system, a batch with no batch before it in the log, a log
format this does not know, a file missing) answers None, and the batch goes through Spark's job as
every batch did before.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from sequin_provider.spark.source import offset_position
from sequin_provider.spark.spool import local_path, spool_path

log = logging.getLogger(__name__)


def default_driver_batch_rows(local_master: bool, max_batch_rows: int) -> int:
    """``stream.driver_batch_rows`` when unset. On a cluster 0: its driver may not reach what the
    executors do. On a local master, every batch (``max_batch_rows``): the job's tasks run on the
    same machine's cores as the driver, the decoder and often the databases, so under load its
    parallel tasks found no idle core, and its scheduling, Python workers and reports cost more than
    they gained (2 cores: 15-16 against 17-18 us of CPU per change, 8-20 % more changes/s;
    docs/performance.md, "The driver writes every batch"). A push sink loses no lanes by it: the
    driver sends over as many as the job's tasks together (``Pipeline.write_small_batches``)."""
    return max_batch_rows if local_master else 0


_unreadable_warned = False


def logged_offset(checkpoint: str, batch_id: int) -> dict[str, Any] | None:
    """The source offset Spark logged for micro-batch ``batch_id`` in a local checkpoint, or None
    (no such entry, another file system, a format this does not know: said once in the log)."""
    folder = local_path(checkpoint)
    if batch_id < 0 or folder is None:
        return None
    try:
        with open(os.path.join(folder, "offsets", str(batch_id)), encoding="utf-8") as log_file:
            lines = log_file.read().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return _unreadable(checkpoint, batch_id, str(exc))
    if len(lines) != 3 or lines[0] != "v1":  # one source: version, metadata, its offset
        return _unreadable(checkpoint, batch_id, f"{len(lines)} lines, version {lines[0] if lines else None!r}")
    try:
        offset = json.loads(lines[2])
        offset_position(offset)
    except (ValueError, TypeError, KeyError) as exc:
        return _unreadable(checkpoint, batch_id, f"source offset {lines[2][:80]!r}: {exc}")
    return offset


def _unreadable(checkpoint: str, batch_id: int, why: str) -> None:
    """Say once per process that Spark's offset log is not what the driver reads (every batch then runs its job)."""
    global _unreadable_warned
    if not _unreadable_warned:
        _unreadable_warned = True
        log.warning(
            "cannot read Spark's offset log entry %s/offsets/%d (%s): micro-batches run their Spark jobs,"
            " none is written by the driver",
            checkpoint,
            batch_id,
            why,
        )
    return None


def batch_spool_file(checkpoint: str, spool: str, batch_id: int) -> str | None:
    """The spool file of micro-batch ``batch_id`` when it exists on this machine, else None."""
    folder = local_path(spool)
    if folder is None:
        return None
    start, end = logged_offset(checkpoint, batch_id - 1), logged_offset(checkpoint, batch_id)
    if start is None or end is None:
        return None
    path = spool_path(folder, offset_position(start), offset_position(end))
    return path if os.path.isfile(path) else None
