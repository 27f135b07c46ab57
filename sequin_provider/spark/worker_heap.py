"""The long-lived heap of a reused PySpark Python worker, kept out of its per-task garbage collection.

PySpark's daemon runs a full ``gc.collect()`` in a reused worker after every task, and a full
collection walks every object the collector tracks. A worker holds about 100,000 that live as
long as it does: the modules it imported (pyspark, pyarrow, psycopg, this package, and what the
first tasks import lazily) and its writer's configuration and renderings. Walking them took
15-50 ms per task; with two Python tasks per partition of every micro-batch, that was two thirds of
the Python workers' CPU at a steady 5,000 changes/s (docs/architecture.md, "Measured refinements"). Frozen, a collection
after a task walks the few hundred objects the task left.

The driver runs each micro-batch's ``foreachBatch`` and, for push and batched sinks on a local
master, their delivery: reading every message back into a few objects each (a postgres_table
change, an Iceberg row), held until the batch is sent. At Python's default thresholds (a young
collection every 700 allocations) those objects were walked again and again, and each full
collection walked the driver's own long-lived heap (pyspark, py4j, pyarrow, pyiceberg): a py-spy
profile of the driver of an Iceberg sink found the collector in a quarter of its Python time.
``tune_driver_collection`` freezes the driver's heap after its first batches and collects less
often, as the reader's process does (``source.READER_GC_THRESHOLDS``).
"""

from __future__ import annotations

import gc

FREEZE_TASKS = 4
"""Tasks of a worker process at whose start what is alive is frozen: the first ones import and
build what the worker keeps (measured: nothing more after the third)."""

_tasks = 0

DRIVER_GC_THRESHOLDS = (100_000, 10, 10)
"""Cyclic GC thresholds of the stream app's driver: a young collection every 100,000 allocations
of tracked objects (a batch's messages make no reference cycles in bulk)."""


def freeze_long_lived() -> None:
    """At the start of each of a worker process's first ``FREEZE_TASKS`` tasks: collect, then move
    every object still alive into the permanent generation (``gc.freeze``), which collections skip.

    The daemon collected after the previous task, so what is frozen is what the worker keeps plus
    this task's own few objects. Frozen objects are still freed when their reference count drops to
    zero; only a cycle among them that became garbage stays (a few hundred objects, once)."""
    global _tasks
    _tasks += 1
    if _tasks <= FREEZE_TASKS:
        gc.collect()
        gc.freeze()


def tune_driver_collection() -> None:
    """At the start of each of the driver's first ``FREEZE_TASKS`` micro-batches: the driver's
    collection thresholds set (``DRIVER_GC_THRESHOLDS``) and its long-lived heap frozen
    (``freeze_long_lived``: the driver counts its batches as a worker counts its tasks)."""
    if _tasks < FREEZE_TASKS:
        gc.set_threshold(*DRIVER_GC_THRESHOLDS)
    freeze_long_lived()
