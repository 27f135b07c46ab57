"""Sink integration tests: the registry, webhooks (client and push), TRUNCATE barriers."""
