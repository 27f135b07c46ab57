"""Operators of the Sequin provider: backfills, the replication stream supervisor, buffer retry."""
