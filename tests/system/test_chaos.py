"""The short chaos round of ``make test`` (``make chaos`` runs the full ones): SIGKILLs of the stream
app (one right after a batch is in the store while the consumers ack it), a Postgres restart, the
store unreachable, a webhook endpoint down, slow and failing, with a backfill started midway;
nothing lost, nothing reordered, no acked message received again, the replay equals the tables."""

from __future__ import annotations

from pathlib import Path

from devtools.embedded_postgres import EmbeddedPostgres
from tests.support.chaos.harness import SHORT, ChaosRound, assert_clean


def test_short_chaos_round_loses_and_reorders_nothing(tmp_path: Path) -> None:
    with EmbeddedPostgres() as pg:  # its own cluster: the round restarts it
        result = ChaosRound(pg, tmp_path / "round", SHORT, 1, seed=7).run()
    print("\n".join(result.lines()))
    assert_clean(result, SHORT)
