"""``make chaos``: full chaos rounds on a throwaway Postgres cluster, one summary per round.

    python -m tests.support.chaos.run --rounds 3 --profile full

Exit code 0 only when every round lost nothing, reordered nothing and replays to the tables'
final state. Logs and results (JSON) go to ``var/chaos/<start time>/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from devtools.embedded_postgres import EmbeddedPostgres
from tests.support.chaos.harness import PROFILES, ChaosRound, RoundResult, write_results

ROOT = Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sequin chaos rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--seed", type=int, default=None, help="first round's seed (default: from the clock)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    out = ROOT / "var" / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    results: list[RoundResult] = []
    with EmbeddedPostgres() as pg:
        for n in range(1, args.rounds + 1):
            result = ChaosRound(
                pg,
                out / f"round-{n}",
                PROFILES[args.profile],
                n,
                seed + n - 1,
                log=lambda line: print(line, flush=True),
            ).run()
            results.append(result)
            print("\n".join(result.lines()), flush=True)
            write_results(out / "results.json", results)
    print(f"\n{sum(r.ok for r in results)}/{len(results)} rounds clean; logs and results.json in {out}")
    for result in results:
        print("\n".join(result.lines()))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
