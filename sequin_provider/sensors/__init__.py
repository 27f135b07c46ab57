"""Sensors of the Sequin provider (deferrable by default)."""
