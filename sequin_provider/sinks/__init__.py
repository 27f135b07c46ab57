"""Destinations: one module per kind (``sinks.base`` the interface, ``sinks.registry`` the kinds).

``kind(name)`` and ``kinds()`` are the registry's."""

from __future__ import annotations

from sequin_provider.sinks.registry import kind, kinds, register

__all__ = ["kind", "kinds", "register"]
