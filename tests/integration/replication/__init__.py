"""Replication integration tests: the pgoutput decoder on a real server, slots, provisioning, restarts."""
