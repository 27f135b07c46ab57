"""The machine's RAM touched once before a benchmark, and what that first touch cost.

These machines are Firecracker virtual machines with free page reporting (``dmesg``: "Free page
reporting enabled", ``page_reporting_order=11``): free memory, in 8 MiB blocks, goes back to the
host, and the guest's next write to it is backed again at about 9 µs per 4 KiB page (about 2 µs
when the host still has it). Every page a benchmark's embedded cluster adds to its page cache
(new WAL segments, each page a COPY adds to a table) and every large buffer a process maps lands
on such memory, so whichever run comes first after a quiet spell pays several times what a busy
server pays: a 1,000,000-row backfill measured 85,000 rows/s as the first run of a fresh machine
and 125,000-145,000 rows/s right after the memory had been written. ``touch_memory`` writes one
byte per page of most of the free memory in a child process that then exits; the host takes the
freed memory back only gradually (minutes for 20 GiB), so the runs that follow start on backed
memory. It reports the seconds this took, a figure of the machine, beside the results.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil

PAGE = 4096
HEADROOM = 2 << 30  # left untouched: the benchmark itself is not to be pushed into reclaim

_TOUCH = """
import sys
size = int(sys.argv[1])
buf = bytearray(size)  # calloc: mapped, not yet touched
buf[::4096] = b"\\x01" * len(range(0, size, 4096))
"""


def touch_memory(gib: float | None = None) -> dict[str, float]:
    """Write once to ``gib`` GiB of memory (default: the free memory less 2 GiB) in a child process.

    Returns the GiB touched, the seconds it took and the cost per 4 KiB page in µs: about 9 on a
    fresh virtual machine, about 2 on one whose memory was touched before."""
    size = int(gib * (1 << 30)) if gib is not None else max(0, psutil.virtual_memory().available - HEADROOM)
    size -= size % PAGE
    if size <= 0:
        return {"gib": 0.0, "seconds": 0.0, "us_per_page": 0.0}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", _TOUCH, str(size)], check=True)
    seconds = time.monotonic() - started
    return {"gib": size / (1 << 30), "seconds": seconds, "us_per_page": seconds / (size // PAGE) * 1e6}


def add_touch_memory_argument(parser: argparse.ArgumentParser) -> None:
    """``--touch-memory GIB`` (default: the free memory less 2 GiB; 0 leaves the memory as it is)."""
    parser.add_argument(
        "--touch-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB of RAM to write once before the runs, so that no run pays a fresh virtual"
        " machine's first touch of its memory (default: the free memory less 2 GiB;"
        " 0: none)",
    )


def touch_memory_for(args: argparse.Namespace) -> dict[str, float]:
    """``touch_memory`` as ``--touch-memory`` asks, with a line saying what it cost."""
    if args.touch_memory is not None and args.touch_memory <= 0:
        print(
            "bench: memory not touched beforehand (--touch-memory 0): the first run may pay the machine's"
            " first touch of its memory",
            flush=True,
        )
        return {"gib": 0.0, "seconds": 0.0, "us_per_page": 0.0}
    figures = touch_memory(args.touch_memory)
    print(
        f"bench: touched {figures['gib']:.1f} GiB of RAM once before the runs: {figures['seconds']:.1f}s,"
        f" {figures['us_per_page']:.2f} us per 4 KiB page (a fresh VM's first touch: ~9 us; touched before:"
        " ~2 us)",
        flush=True,
    )
    return figures
