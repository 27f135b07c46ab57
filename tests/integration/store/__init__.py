"""Store integration tests: the stream table, the queue, the buffer, backfill rows."""
