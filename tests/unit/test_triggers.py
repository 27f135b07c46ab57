"""The deferrable triggers without a server: serialisation round trip, arguments checked at construction
(events on real Postgres: tests/integration/airflow/test_triggers.py)."""

from __future__ import annotations

import importlib
import json

import pytest

from sequin_provider.triggers.sequin import (
    BackfillCompletedTrigger,
    HeartbeatTrigger,
    ParkedMessagesTrigger,
    SequinPollingTrigger,
    SlotLagTrigger,
)
from tests.support.airflow import FAST_TRIGGER as FAST


@pytest.mark.parametrize(
    "trigger",
    [
        SlotLagTrigger(slot="s", threshold_bytes=1024, fire_when="within", end_time=123.5, **FAST),
        HeartbeatTrigger(database="shop", max_age_seconds=30, **FAST),
        ParkedMessagesTrigger(sink="orders", threshold=5, end_time=None, **FAST),
        ParkedMessagesTrigger(**FAST),
        BackfillCompletedTrigger(backfill_id=7, end_time=99.0, **FAST),
    ],
    ids=lambda t: type(t).__name__,
)
def test_serialize_round_trips(trigger: SequinPollingTrigger) -> None:
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is type(trigger)
    json.dumps(kwargs)  # the triggerer stores the kwargs: they must be plain JSON
    rebuilt = cls(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert kwargs["sequin_conn_id"] == "sequin_trig" and kwargs["poke_interval"] == 0.05
    assert {k: v for k, v in vars(rebuilt).items() if k in kwargs} == kwargs


def test_invalid_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="fire_when"):
        SlotLagTrigger(slot="s", threshold_bytes=1, fire_when="above")
    with pytest.raises(ValueError, match="threshold"):
        ParkedMessagesTrigger(threshold=-1)
