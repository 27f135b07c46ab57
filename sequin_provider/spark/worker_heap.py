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

The reader, the driver and the workers also build each batch's strings anew (a 64 MB batch of
wide rows is tens of thousands of allocations above Python's small-object limit, which glibc's
``malloc`` serves). At its defaults glibc gives the top of its heap back to the kernel when a batch is
freed (``free`` trims what is free above 128 KiB, or above twice the largest mapped block the
process has freed so far, at most 64 MiB: the default depends on the process's history), so the
next batch's allocations fault fresh zeroed pages in again: up to 16,000 minor faults per 64 MB
batch, and 40 % of the reader's samples in a ``perf`` profile of the identity-full case were the
kernel zeroing them (``bench/heap_pages.py`` measures it). ``keep_heap_pages`` raises
glibc's trim and mmap thresholds so the pages freed by one batch serve the next.
"""

from __future__ import annotations

import ctypes
import gc

FREEZE_TASKS = 4
"""Tasks of a worker process at whose start what is alive is frozen: the first ones import and
build what the worker keeps (measured: nothing more after the third)."""

_tasks = 0

DRIVER_GC_THRESHOLDS = (100_000, 10, 10)
"""Cyclic GC thresholds of the stream app's driver: a young collection every 100,000 allocations
of tracked objects (a batch's messages make no reference cycles in bulk)."""


HEAP_TRIM_THRESHOLD = 256 * 1024 * 1024
"""Free memory glibc keeps at the top of its heap before it gives any back to the kernel: what a
large batch frees (a 64 MB batch of wide rows; ``stream.max_batch_bytes`` caps a batch at 256 MiB)."""

HEAP_MMAP_THRESHOLD = 32 * 1024 * 1024
"""Allocations from this size up get a mapping of their own (and give it back when freed); below
it, they come from the heap that ``HEAP_TRIM_THRESHOLD`` keeps. A value of 5 MB (a TOASTed
column) is served from the heap; a mapping is kept for what is rarer and larger."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_heap_pages() -> bool:
    """Tell glibc's ``malloc`` to keep the pages a freed batch leaves for the next batch, instead of
    giving them back to the kernel and faulting them in again (``HEAP_TRIM_THRESHOLD``,
    ``HEAP_MMAP_THRESHOLD``). For a process that builds one batch after another: the reader, the
    driver and the reused Python workers (``freeze_long_lived``). Returns whether it took effect:
    False where the C library is not glibc (musl, macOS), where there is nothing to tune and the
    defaults stay."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols, the C library's among them
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)) and bool(
        mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
    )


def freeze_long_lived() -> None:
    """At the start of each of a worker process's first ``FREEZE_TASKS`` tasks: collect, then move
    every object still alive into the permanent generation (``gc.freeze``), which collections skip.

    The daemon collected after the previous task, so what is frozen is what the worker keeps plus
    this task's own few objects. Frozen objects are still freed when their reference count drops to
    zero; only a cycle among them that became garbage stays (a few hundred objects, once). At the
    first task, the process's heap pages are also kept from task to task (``keep_heap_pages``)."""
    global _tasks
    _tasks += 1
    if _tasks == 1:
        keep_heap_pages()
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
