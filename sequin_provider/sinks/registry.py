"""The destination kinds, by ``destination.type``: the only place a destination is named.

The built-in kinds' modules (``BUILTIN_MODULES``) are imported the first time a kind is looked up,
not when this module is, so the config parser can import the registry without importing the
pipeline; each module registers its kind (``register``) when imported. A new destination is one
module (a ``DestinationKind``, ``sinks.base``, registered at its end) named in ``BUILTIN_MODULES``,
plus its test.
"""

from __future__ import annotations

import importlib
import threading

from sequin_provider.sinks.base import DestinationKind

BUILTIN_MODULES = (
    "sequin_provider.sinks.sequin_stream",
    "sequin_provider.sinks.webhook",
    "sequin_provider.sinks.nats_jetstream",
    "sequin_provider.sinks.redis_stream",
    "sequin_provider.sinks.rabbitmq",
    "sequin_provider.sinks.postgres_table",
    "sequin_provider.sinks.iceberg",
)
"""Modules that register the built-in destination kinds, in the order they are listed."""

_KINDS: dict[str, DestinationKind] = {}
_LOADED = threading.Event()
_LOADING = threading.RLock()


class UnknownDestinationError(LookupError):
    """No destination kind is registered under a ``destination.type``; names the registered ones."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown destination type {name!r} ({' | '.join(known)})")
        self.name = name
        self.known = known


def register(kind: DestinationKind) -> DestinationKind:
    """Register ``kind`` under its ``name`` (again: replaces an earlier instance of the same class)."""
    known = _KINDS.get(kind.name)
    if known is not None and type(known) is not type(kind):
        raise ValueError(f"destination type {kind.name!r} is already registered by {type(known).__qualname__}")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (tests that register their own)."""
    _KINDS.pop(name, None)


def _load_builtins() -> None:
    if _LOADED.is_set():
        return
    with _LOADING:
        if not _LOADED.is_set():
            for module in BUILTIN_MODULES:
                importlib.import_module(module)
            _LOADED.set()


def kind(name: str) -> DestinationKind:
    """The kind registered as ``name``; ``UnknownDestinationError`` lists the registered ones."""
    _load_builtins()
    found = _KINDS.get(name)
    if found is None:
        raise UnknownDestinationError(name, names())
    return found


def kinds() -> tuple[DestinationKind, ...]:
    """Every registered kind, built-in ones first."""
    _load_builtins()

    def order(k: DestinationKind) -> int:
        module = type(k).__module__
        return BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES else len(BUILTIN_MODULES)

    return tuple(sorted(_KINDS.values(), key=order))  # stable: the others in the order they were registered


def names() -> list[str]:
    """The registered ``destination.type`` names."""
    return [k.name for k in kinds()]
