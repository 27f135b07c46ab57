"""Ack ids: what one holds, and the compiled ack ids (``_ack_ids_c``) equal to their Python
references on the same inputs, hostile ones included. No database."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from sequin_provider import _ack_ids_c, ack_ids

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


def test_the_compiled_positions_take_canonical_text_and_uuids_and_leave_other_forms_to_the_reference() -> None:
    """The fallback must not hide a compiled parser that gives up on the forms it is for."""
    texts = [ack_ids.format_ack_id(*p) for p in EDGES + random_positions(200, seed=3)]
    expected = ack_ids.parse_positions(texts)
    for ids in (texts, [t.upper() for t in texts], [uuid.UUID(t) for t in texts]):
        assert _ack_ids_c.positions(ids, uuid.UUID) == expected
    for other in ("{" + texts[0] + "}", texts[0].replace("-", ""), "urn:uuid:" + texts[0], "é" * 36):
        assert _ack_ids_c.positions([texts[1], other], uuid.UUID) is None
    assert ack_ids.positions(iter([texts[0], "{" + texts[1] + "}"])) == ack_ids.parse_positions(texts[:2])


def test_ids_that_differ_in_one_part_only_are_each_counted_once_and_kept_apart() -> None:
    """Positions alike but for the high bits of the LSN, or the index, or the nonce: none may be
    taken for a repeat of another (the dedupe keys on all 122 bits)."""
    base = (0x16B3F28, 7, 12345)
    variants = [(base[0] | 1 << b, base[1], base[2]) for b in range(40, 63)]
    variants += [(base[0], 1 << b, base[2]) for b in range(31)] + [(base[0], base[1], 1 << b) for b in range(28)]
    ids = [ack_ids.format_ack_id(*p) for p in [base, *variants]]
    got = ack_ids.positions(ids + ids[::-1])
    assert got == ack_ids.parse_positions(ids) == tuple(map(list, zip(base, *variants)))


def test_the_compiled_dedupe_is_not_slowed_by_ids_built_to_collide() -> None:
    """10,000 ids sharing their nonce and low bits (what a token holder may send) take about as
    long as 10,000 ordinary ones: the hash slot comes from all of an id's bits. A ratio, not a
    wall-clock threshold; a table keyed on the low bits measured 12x."""
    alike = [ack_ids.format_ack_id(i << 20, 0, 5) for i in range(10_000)]
    ordinary = [ack_ids.format_ack_id(*p) for p in random_positions(10_000, seed=5)]

    def took(ids: list[str]) -> float:
        started = time.perf_counter()
        for _ in range(5):
            _ack_ids_c.positions(ids, uuid.UUID)
        return time.perf_counter() - started

    assert min(took(alike) for _ in range(3)) < 4 * max(took(ordinary) for _ in range(3))


def test_a_list_changed_by_a_uuids_int_does_not_crash_the_compiled_parser() -> None:
    """The compiled parser reads a copy: Python code it runs (a UUID subclass's ``int``) may empty
    the caller's list."""
    ids: list[object] = []

    class Clearing(uuid.UUID):
        def __getattribute__(self, name: str) -> object:
            if name == "int":
                ids.clear()
            return super().__getattribute__(name)

    texts = [ack_ids.format_ack_id(i, 0, 1) for i in range(50)]
    ids.extend([Clearing(texts[0]), *texts[1:]])
    assert _ack_ids_c.positions(ids, uuid.UUID) == ack_ids.parse_positions(texts)
