"""Resident memory of a process tree (the stream app, its JVM, its Python workers), sampled.

The memory test of large transactions and ``bench/large_transaction.py`` both measure the peak RSS of
the stream app's processes while one transaction streams through; this is the one way they count it.
"""

from __future__ import annotations

import threading

import psutil


def jvm_fork(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a child the JVM forked that has not yet run another program (Hadoop's
    shell commands, from the stream execution thread): for a moment it shows the whole JVM's RSS,
    pages it shares with its parent. Counted, a sample that caught one added the JVM twice (CI's
    2,551 -> 3,340 MiB at 1,000,000 rows in tests/system/test_large_transactions.py was one JVM's worth)."""
    parent = proc.parent()
    return parent is not None and parent.name() == "java" and proc.exe() == parent.exe()


def tree_rss(pid: int) -> dict[str, int]:
    """Resident memory of a process and each of its descendants by ``name[pid]``, without the JVM's
    momentary forks (``jvm_fork``); empty once the process is gone."""
    sizes: dict[str, int] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return sizes
    for proc in procs:
        try:
            if not jvm_fork(proc):
                sizes[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sizes


class PeakRss:
    """Samples a process tree's RSS from a thread while in its ``with`` block; ``peak`` is the
    largest sum seen and ``at_peak`` what each process held then (``breakdown`` prints it, so a
    failure says which process grew)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        """Take one sample now; returns its sum."""
        sizes = tree_rss(self.pid)
        total = sum(sizes.values())
        if total > self.peak:
            self.peak, self.at_peak = total, sizes
        return total

    def breakdown(self) -> str:
        """The processes' RSS at the peak, largest first, in MiB."""
        return ", ".join(
            f"{name} {rss / 2**20:,.0f}" for name, rss in sorted(self.at_peak.items(), key=lambda item: -item[1])
        )

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
