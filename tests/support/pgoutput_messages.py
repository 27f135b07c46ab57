"""pgoutput messages built by hand, for the decoders' tests (no server needed to make them)."""

from __future__ import annotations

import struct


def relation_message(relid: int, columns: list[tuple[str, int]]) -> bytes:
    """A pgoutput Relation message of public.t with ``columns`` (name, type oid); the first is the key."""
    body = b"".join(
        bytes([1 if i == 0 else 0]) + name.encode() + b"\0" + struct.pack(">Ii", oid, -1)
        for i, (name, oid) in enumerate(columns)
    )
    return b"R" + struct.pack(">I", relid) + b"public\0t\0d" + struct.pack(">h", len(columns)) + body


def insert_message(relid: int, values: list[bytes | None]) -> bytes:
    """A pgoutput Insert message with text ``values`` (None: null)."""
    body = b"".join(b"n" if v is None else b"t" + struct.pack(">i", len(v)) + v for v in values)
    return b"I" + struct.pack(">I", relid) + b"N" + struct.pack(">h", len(values)) + body
