"""Ack ids of the pull API: each one is an RFC 9562 version-8 UUID holding its message's position
(commit LSN and index) and its delivery's random nonce, so an ack finds its message by primary key
(no ack-id index to write) and the ack id of an earlier delivery of the same message matches
nothing (migration 10).

``format_ack_id`` and ``parse_positions`` are the definitions, in Python. A receive makes an ack
id per message and an ack parses one per message, in the API process: ``ack_ids`` and
``positions`` run them compiled (``_ack_ids_c``, optional: without a compiler the references run),
0.1 µs per id against 1.2 and 0.7 µs in Python.
"""

from __future__ import annotations

import uuid
from typing import Sequence

_IDX_BITS, _NONCE_BITS = 31, 28
NONCE_LIMIT = 1 << _NONCE_BITS
"""Nonces are drawn below this (28 bits), by the store's claim."""
_LOW62 = (1 << 62) - 1

Positions = tuple[list[int], list[int], list[int]]
"""Commit LSNs, commit indexes and nonces, element by element (``store.Deliveries``)."""


def format_ack_id(commit_lsn: int, commit_idx: int, nonce: int) -> str:
    """The ack id of one delivery: its position and nonce, 122 bits, laid around the UUID's version
    and variant bits. Raises ValueError for a position or nonce out of range."""
    if not (0 <= commit_lsn < 1 << 63 and 0 <= commit_idx < 1 << _IDX_BITS and 0 <= nonce < NONCE_LIMIT):
        raise ValueError(f"position ({commit_lsn}, {commit_idx}) or nonce {nonce} out of range")
    value = (commit_lsn << (_IDX_BITS + _NONCE_BITS)) | (commit_idx << _NONCE_BITS) | nonce  # 122 bits
    u = (value >> 74 << 80) | (0x8 << 76) | ((value >> 62 & 0xFFF) << 64) | (0b10 << 62) | (value & _LOW62)
    h = f"{u:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def parse_ack_id(ack_id: str | uuid.UUID) -> tuple[int, int, int] | None:
    """(commit_lsn, commit_idx, nonce) of an ack id made by ``format_ack_id``; None for a UUID of
    another version or variant (any other version-8 UUID parses too, and matches a message only if
    its position and nonce do). Raises ValueError for text that is not a UUID."""
    u = (ack_id if isinstance(ack_id, uuid.UUID) else uuid.UUID(ack_id)).int
    if u >> 76 & 0xF != 0x8 or u >> 62 & 0b11 != 0b10:
        return None
    value = (u >> 80 << 74) | ((u >> 64 & 0xFFF) << 62) | (u & _LOW62)
    return value >> (_IDX_BITS + _NONCE_BITS), value >> _NONCE_BITS & ((1 << _IDX_BITS) - 1), value & (NONCE_LIMIT - 1)


def parse_positions(ack_ids: Sequence[str | uuid.UUID]) -> Positions:
    """The positions and nonces of ``ack_ids``, each once, in first-seen order; ids that are not
    ours are left out. Raises ValueError for text that is not a UUID."""
    parsed = [p for p in dict.fromkeys(map(parse_ack_id, ack_ids)) if p is not None]
    return [p[0] for p in parsed], [p[1] for p in parsed], [p[2] for p in parsed]


try:  # built by `pip install` from _ack_ids_c.c (optional: without a compiler the references run)
    from sequin_provider import _ack_ids_c as _compiled
except ImportError:  # pragma: no cover - depends on the build
    _compiled = None  # type: ignore[assignment]

COMPILED = _compiled is not None
"""Whether the compiled ack ids (``_ack_ids_c``) are built."""


def ack_ids(claimed: Sequence[tuple[int, int, int, object]], compiled: bool = COMPILED) -> list[str]:
    """The ack id of each claimed row, a tuple ``(commit_lsn, commit_idx, nonce, ...)`` of ints
    (``format_ack_id``)."""
    if compiled:
        return _compiled.ack_ids(claimed)  # type: ignore[union-attr]
    return [format_ack_id(row[0], row[1], row[2]) for row in claimed]


def positions(ack_ids: Sequence[str | uuid.UUID], compiled: bool = COMPILED) -> Positions:
    """``parse_positions``: compiled for ``uuid.UUID`` objects and UUIDs' canonical text, the
    reference for any other form ``uuid.UUID`` takes (braces, no hyphens, a ``urn:uuid:`` prefix)."""
    if compiled:
        if not isinstance(ack_ids, (list, tuple)):
            ack_ids = list(ack_ids)  # read twice when the reference takes over
        found = _compiled.positions(ack_ids, uuid.UUID)  # type: ignore[union-attr]
        if found is not None:
            return found  # type: ignore[no-any-return]
    return parse_positions(ack_ids)
