"""The pull API's own work per message, outside HTTP and the store: ack ids made and parsed, compiled
beside their Python references, and a client's disconnect checked two ways.

    .venv/bin/python bench/api_per_message.py [--batch 100] [--repeat 2000]

In this process, no server: per ``--batch`` messages, CPU time (``time.process_time``) per message of
  - a receive's deliveries (``stream_queue``'s claimed rows in position order with their ack ids):
    ``ack_ids.ack_ids`` compiled, and the reference ``format_ack_id`` per row (``compiled=False``);
  - an ack's positions (``ack_ids.positions``) from ``uuid.UUID`` objects, as the API's validated
    body holds them, compiled and by the reference;
and per request, a disconnect checked by Starlette's ``Request.is_disconnected`` (a cancelled receive,
twice per receive before ``ClientConnection`` watched with one task) beside one watch task started
and cancelled (``stream_api.ClientConnection`` entered and left). Both ways must give the same ids and positions (checked). Prints a Markdown table and
writes bench/results/api_per_message.json. Not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from starlette.requests import Request  # noqa: E402

from sequin_provider import ack_ids  # noqa: E402
from sequin_provider.stream_api import ClientConnection  # noqa: E402

RUNS = 5


def cpu_us(work: Callable[[], Any], repeat: int, per: int) -> float:
    """Median over ``RUNS`` of the CPU µs one call of ``work`` takes, divided by ``per``."""
    times = []
    for _ in range(RUNS):
        started = time.process_time()
        for _ in range(repeat):
            work()
        times.append((time.process_time() - started) / repeat / per * 1e6)
    return statistics.median(times)


def disconnect_checks(repeat: int) -> dict[str, float]:
    """µs per request: Starlette's ``is_disconnected`` against ``stream_api.ClientConnection`` (its
    watch task started, looked at and cancelled), on a receive that waits as a server's does for a
    connected client."""

    async def measure() -> dict[str, float]:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}

        async def ask() -> None:
            await Request(scope, receive).is_disconnected()

        async def watch() -> None:
            async with ClientConnection(Request(scope, receive)) as client:
                client.gone()

        out = {}
        for name, check in (("is_disconnected", ask), ("watch_task", watch)):
            times = []
            for _ in range(RUNS):
                started = time.process_time()
                for _ in range(repeat):
                    await check()
                times.append((time.process_time() - started) / repeat * 1e6)
            out[name] = statistics.median(times)
        return out

    return asyncio.run(measure())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    if not ack_ids.COMPILED:
        raise SystemExit("the compiled ack ids (sequin_provider._ack_ids_c) are not built: make venv")
    claimed = [(0x16B3F28 + i, i, 12345 + i, "{}") for i in range(args.batch)]
    ids = ack_ids.ack_ids(claimed)
    assert ids == ack_ids.ack_ids(claimed, compiled=False)
    uuids = [uuid.UUID(i) for i in ids]
    assert ack_ids.positions(uuids) == ack_ids.positions(uuids, compiled=False)
    results = {
        "batch": args.batch,
        "ack_ids_compiled": cpu_us(lambda: ack_ids.ack_ids(claimed), args.repeat, args.batch),
        "ack_ids_reference": cpu_us(lambda: ack_ids.ack_ids(claimed, compiled=False), args.repeat, args.batch),
        "positions_compiled": cpu_us(lambda: ack_ids.positions(uuids), args.repeat, args.batch),
        "positions_reference": cpu_us(lambda: ack_ids.positions(uuids, compiled=False), args.repeat, args.batch),
        **{f"disconnect_{k}": v for k, v in disconnect_checks(args.repeat).items()},
    }
    print(
        f"\nThe pull API's own work, CPU µs, median of {RUNS} runs of {args.repeat:,} (batches of {args.batch}):\n\n"
        "| work | compiled / now | Python reference / before |\n|---|---:|---:|\n"
        f"| a receive's ack ids, per message | {results['ack_ids_compiled']:.2f} | {results['ack_ids_reference']:.2f} |\n"
        f"| an ack's positions, per message | {results['positions_compiled']:.2f} | "
        f"{results['positions_reference']:.2f} |\n"
        f"| a disconnect check, per request (a watch task / `is_disconnected`) | "
        f"{results['disconnect_watch_task']:.1f} | {results['disconnect_is_disconnected']:.1f} |"
    )
    out = ROOT / "bench" / "results" / "api_per_message.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
