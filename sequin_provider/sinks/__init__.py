"""Destinations: one module per sink type."""
