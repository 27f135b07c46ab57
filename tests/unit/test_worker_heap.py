"""worker_heap: a reused Python worker's long-lived objects are frozen in its first tasks only, and the
driver's in its first micro-batches, with collections less often.

Run in a child interpreter: ``gc.freeze`` is process-wide and would change this test process's own
collections."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from sequin_provider.spark.worker_heap import DRIVER_GC_THRESHOLDS, FREEZE_TASKS

CHILD = textwrap.dedent("""
    import gc, json
    from sequin_provider.spark import worker_heap

    before = gc.get_freeze_count()
    long_lived = [[i] for i in range(5000)]                 # what a worker's first task builds and keeps
    counts = []
    for task in range(worker_heap.FREEZE_TASKS + 2):
        worker_heap.freeze_long_lived()
        counts.append(gc.get_freeze_count())
        long_lived.append([[task] for _ in range(1000)])        # kept past the freezing tasks
    gc.collect()
    unfrozen = len(gc.get_objects())                         # what a collection still walks
    print(json.dumps({"before": before, "counts": counts, "unfrozen": unfrozen}))
""")


def run_child() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_first_tasks_freeze_what_is_alive_and_later_tasks_do_not() -> None:
    result = run_child()
    counts = result["counts"]
    assert result["before"] == 0
    assert counts[0] > 5000  # the worker's modules and the 5,000 kept lists
    # each freezing task adds what the previous task kept (1,001 lists; lists are always tracked)
    for earlier, later in zip(counts[: FREEZE_TASKS - 1], counts[1:FREEZE_TASKS]):
        assert later >= earlier + 1000
    # after FREEZE_TASKS tasks nothing more is frozen
    assert counts[FREEZE_TASKS:] == [counts[FREEZE_TASKS - 1]] * 2


def test_a_collection_after_the_freezing_tasks_walks_only_what_came_later() -> None:
    result = run_child()
    # what the last freezing task and the two after it kept (3 x 1,001 lists), plus the little the
    # loop leaves: not the tens of thousands of objects the interpreter and its imports hold
    assert 3003 <= result["unfrozen"] < 3003 + 100


DRIVER_CHILD = textwrap.dedent("""
    import gc, json
    from sequin_provider.spark import worker_heap

    default = gc.get_threshold()
    counts = []
    for batch in range(worker_heap.FREEZE_TASKS + 2):
        worker_heap.tune_driver_collection()
        counts.append(gc.get_freeze_count())
    print(json.dumps({"default": default, "tuned": gc.get_threshold(), "counts": counts}))
""")


def test_the_driver_collects_less_often_and_freezes_its_heap_in_its_first_batches() -> None:
    out = subprocess.run([sys.executable, "-c", DRIVER_CHILD], capture_output=True, text=True, check=True, timeout=60)
    result = json.loads(out.stdout)
    assert result["default"] == [700, 10, 10]
    assert result["tuned"] == list(DRIVER_GC_THRESHOLDS)
    counts = result["counts"]
    assert counts[0] > 1000  # the interpreter's and the imports' objects
    assert counts[FREEZE_TASKS:] == [counts[FREEZE_TASKS - 1]] * 2


HEAP_CHILD = textwrap.dedent("""
    import json, resource, sys
    from sequin_provider.spark import worker_heap

    kept = False
    if sys.argv[1] == "keep":
        kept = worker_heap.keep_heap_pages()
    elif sys.argv[1] == "first task":                      # a reused worker's first task keeps them too
        worker_heap.freeze_long_lived()
        kept = True
    faults = []
    for batch in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # one 64 MB batch of 1.6 kB rows, above Python's small-object limit: glibc's malloc serves them
        rows = [b"x" * 1600 + i.to_bytes(4, "little") for i in range(40_000)]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del rows
    print(json.dumps({"kept": kept, "faults": faults}))
""")


def heap_faults(mode: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_CHILD, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout)


def test_kept_heap_pages_serve_the_next_batch_without_faulting_them_in_again() -> None:
    default, kept, first_task = heap_faults("default"), heap_faults("keep"), heap_faults("first task")
    assert default["kept"] is False
    if not kept["kept"]:
        pytest.skip("the C library is not glibc: keep_heap_pages has nothing to tune")
    pages = 40_000 * 1604 // 4096  # the batch's pages: ~15,700
    # at glibc's defaults each batch's pages are given back when it is freed, and faulted in again
    assert all(f > pages // 2 for f in default["faults"]), default
    # kept, the first batch faults them in once and the next batches reuse them
    for run in (kept, first_task):
        assert run["faults"][0] > pages // 2, run
        assert all(f < pages // 50 for f in run["faults"][1:]), run
