"""Ack ids: what one holds, and the compiled ack ids (``_ack_ids_c``) equal to their Python
references on the same inputs, hostile ones included. No database."""

from __future__ import annotations

import random
import uuid

import pytest

from sequin_provider import ack_ids

EDGES = [(0, 0, 0), ((1 << 63) - 1, (1 << 31) - 1, (1 << 28) - 1), (0x16B3F28, 7, 12345), (1 << 62, 1 << 30, 1 << 27)]
OUT_OF_RANGE = [(-1, 0, 0), (1 << 63, 0, 0), (0, 1 << 31, 0), (0, 0, 1 << 28), (0, -1, 0), (0, 0, -1), (1 << 200, 0, 0)]


def random_positions(n: int, seed: int = 7) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    bits = [(63, 31, 28), (40, 8, 28), (5, 3, 2), (64 - 1, 1, 1)]
    return [tuple(rng.getrandbits(b) for b in rng.choice(bits)) for _ in range(n)]  # type: ignore[misc]


def test_an_ack_id_holds_the_position_and_a_nonce_and_no_other_uuid_matches() -> None:
    for lsn, idx, nonce in EDGES:
        text = ack_ids.format_ack_id(lsn, idx, nonce)
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 8 and parsed.variant == uuid.RFC_4122
        assert ack_ids.parse_ack_id(text) == ack_ids.parse_ack_id(parsed) == (lsn, idx, nonce)
    assert ack_ids.format_ack_id(1, 2, 3) != ack_ids.format_ack_id(1, 2, 4) != ack_ids.format_ack_id(1, 3, 3)
    assert ack_ids.parse_ack_id(str(uuid.uuid4())) is None  # not ours: matches nothing
    assert ack_ids.parse_ack_id(uuid.UUID(int=0)) is None
    for bad in OUT_OF_RANGE:
        with pytest.raises(ValueError):
            ack_ids.format_ack_id(*bad)
    with pytest.raises(ValueError):
        ack_ids.parse_ack_id("not-a-uuid")


def test_the_ack_ids_are_compiled() -> None:
    """The build (``make venv``) compiles them; without it the API would run the references."""
    assert ack_ids.COMPILED


@pytest.mark.parametrize("compiled", [False, True])
def test_ack_ids_equal_the_reference(compiled: bool) -> None:
    rows = [(*p, f'{{"n":{i}}}') for i, p in enumerate(random_positions(5_000) + EDGES)]
    assert ack_ids.ack_ids(rows, compiled=compiled) == [ack_ids.format_ack_id(*r[:3]) for r in rows]
    assert ack_ids.ack_ids([], compiled=compiled) == []
    for bad in OUT_OF_RANGE:
        with pytest.raises(ValueError, match=r"out of range"):
            ack_ids.ack_ids([(*bad, "{}")], compiled=compiled)
    with pytest.raises(TypeError):
        ack_ids.ack_ids([(1.5, 0, 0, "{}")], compiled=compiled)


@pytest.mark.parametrize("compiled", [False, True])
def test_positions_equal_the_reference_in_every_form_and_count_each_id_once(compiled: bool) -> None:
    positions = list(dict.fromkeys(random_positions(3_000, seed=11) + EDGES))
    texts = [ack_ids.format_ack_id(*p) for p in positions]
    foreign = [str(uuid.uuid4()) for _ in range(50)] + [str(uuid.UUID(int=0)), "ffffffff-ffff-8fff-ffff-ffffffffffff"]
    forms: list[list[str | uuid.UUID]] = [
        list(texts),  # canonical text, as clients send it
        [uuid.UUID(t) for t in texts],  # uuid.UUID objects, as the API's validated body holds them
        [t.upper() for t in texts],
        [t.replace("-", "") for t in texts],  # other forms uuid.UUID takes: the reference's path
        ["{" + t + "}" for t in texts],
        ["urn:uuid:" + t for t in texts],
    ]
    for ids in forms:
        mixed = ids + foreign + ids[:100] + ids[::-1]  # repeats count once, in first-seen order
        assert ack_ids.positions(mixed, compiled=compiled) == ack_ids.parse_positions(mixed)
        assert ack_ids.positions(mixed, compiled=compiled) == tuple(map(list, zip(*positions)))
    assert ack_ids.positions([], compiled=compiled) == ([], [], [])
    for bad in ["not-a-uuid", "", "0" * 36, texts[0][:-1] + "g", texts[0] + "0"]:
        with pytest.raises(ValueError):
            ack_ids.positions([texts[1], bad], compiled=compiled)
    with pytest.raises((TypeError, AttributeError)):
        ack_ids.positions([texts[1], 42], compiled=compiled)  # type: ignore[list-item]
