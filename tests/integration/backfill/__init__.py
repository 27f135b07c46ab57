"""Backfill integration tests: planning, placement, the source SQL, the backfill app and server."""
