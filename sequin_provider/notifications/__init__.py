"""Notifiers of the Sequin provider."""
