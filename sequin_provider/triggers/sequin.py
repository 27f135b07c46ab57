"""Deferrable triggers that poll a Sequin deployment until a condition holds (DESIGN §10).

Each trigger polls every ``poke_interval`` seconds and yields exactly one event:

- ``{"status": "success", "message": ..., <observation>}`` when its condition holds;
- ``{"status": "timeout", "message": ..., <last observation>}`` once ``end_time`` (epoch seconds,
  absolute so that a triggerer restart does not extend the wait) has passed;
- ``{"status": "error", "message": ...}`` on any failure (unreachable database, missing slot,
  failed backfill, ...): ``run`` never raises.

Direction of the threshold triggers (slot lag, heartbeat age, parked messages): by default
(``fire_when="exceeds"``) the condition is the *alert* -- lag above the threshold, a heartbeat
older than the maximum age (or none at all), more parked messages than the threshold -- so a
monitoring DAG chains the sensor to a notifier, and a timeout means "healthy for the whole
window" (use ``soft_fail=True`` on the sensor to turn that into a skip). ``fire_when="within"``
waits for the opposite, healthy state instead: replication caught up, the stream app alive, the
buffer drained -- useful to gate work on a recovered pipeline.

The decision itself (``evaluate``) is a pure function of one measurement, shared with the
sensors' ``poke``, so poke mode and deferred mode cannot disagree.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from sequin_provider import store
from sequin_provider.backfill import progress_line
from sequin_provider.exceptions import ConditionError
from sequin_provider.hooks.sequin import SequinHook

FIRE_WHEN = ("exceeds", "within")
"""``exceeds``: fire when the value is above the threshold (alert); ``within``: at or below it."""
BACKFILL_FAILED_STATES = ("failed", "cancelled")


SequinConditionError = ConditionError
"""The watched condition can never hold (slot gone, backfill failed): an error event, with details
(``exceptions.ConditionError``, under the name this module always gave it)."""


@dataclass(frozen=True)
class Observation:
    """One measurement judged: is the condition met, what was seen (JSON-serialisable), in words."""

    done: bool
    message: str
    payload: dict[str, Any] = field(default_factory=dict)

    def event(self, status: str) -> dict[str, Any]:
        """The trigger event payload (and the sensors' return value) for this observation."""
        return {**self.payload, "status": status, "message": self.message}


def check_fire_when(value: str) -> str:
    """``exceeds`` or ``within``."""
    if value not in FIRE_WHEN:
        raise ValueError(f"fire_when must be one of {FIRE_WHEN}, got {value!r}")
    return value


def check_non_negative(name: str, value: Any) -> float:
    """A threshold: a number >= 0 (templated values arrive as strings)."""
    number = float(value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


class SequinPollingTrigger(BaseTrigger):
    """Polls one measurement of a ``sequin`` connection until ``evaluate`` says done.

    :param sequin_conn_id: the ``sequin`` connection.
    :param poke_interval: seconds between two measurements.
    :param end_time: epoch seconds after which a ``timeout`` event is sent (None: never).
    """

    def __init__(
        self,
        *,
        sequin_conn_id: str = SequinHook.default_conn_name,
        poke_interval: float = 60.0,
        end_time: float | None = None,
    ) -> None:
        super().__init__()
        self.sequin_conn_id = sequin_conn_id
        self.poke_interval = float(poke_interval)
        self.end_time = None if end_time is None else float(end_time)

    @abc.abstractmethod
    def condition_kwargs(self) -> dict[str, Any]:
        """The subclass's own constructor arguments."""

    @abc.abstractmethod
    def measure(self, hook: SequinHook) -> Any:
        """Take the measurement (blocking; used by the sensors' ``poke``)."""

    @abc.abstractmethod
    async def ameasure(self, hook: SequinHook) -> Any:
        """Take the measurement without blocking the event loop."""

    @abc.abstractmethod
    def evaluate(self, value: Any) -> Observation:
        """Judge a measurement; raise ``SequinConditionError`` if the condition can never hold."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Class path and the keyword arguments that rebuild this trigger."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                **self.condition_kwargs(),
                "sequin_conn_id": self.sequin_conn_id,
                "poke_interval": self.poke_interval,
                "end_time": self.end_time,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll until done, timed out or failed; yield one event."""
        yield TriggerEvent(await self.poll(SequinHook(self.sequin_conn_id)))

    async def poll(self, hook: SequinHook) -> dict[str, Any]:
        """The loop of ``run``, returning the event payload."""
        try:
            while True:
                observation = self.evaluate(await self.ameasure(hook))
                if observation.done:
                    return observation.event("success")
                if self.end_time is not None and time.time() >= self.end_time:
                    timed_out = Observation(False, f"timed out waiting: {observation.message}", observation.payload)
                    return timed_out.event("timeout")
                self.log.info("%s; next check in %.1fs", observation.message, self.poke_interval)
                await asyncio.sleep(self.poke_interval)
        except SequinConditionError as exc:
            return {**exc.payload, "status": "error", "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a trigger reports failures as events
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}


class SlotLagTrigger(SequinPollingTrigger):
    """Fires when replication slot ``slot`` lags more than ``threshold_bytes`` behind the server's
    WAL position (``fire_when="within"``: when it lags at most that much, i.e. has caught up).
    A missing slot is an error: nothing is replicating."""

    def __init__(self, *, slot: str, threshold_bytes: int, fire_when: str = "exceeds", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slot = slot
        self.threshold_bytes = int(check_non_negative("threshold_bytes", threshold_bytes))
        self.fire_when = check_fire_when(fire_when)

    def condition_kwargs(self) -> dict[str, Any]:
        return {"slot": self.slot, "threshold_bytes": self.threshold_bytes, "fire_when": self.fire_when}

    def measure(self, hook: SequinHook) -> int | None:
        return hook.slot_lag_bytes(self.slot)

    async def ameasure(self, hook: SequinHook) -> int | None:
        return await hook.aslot_lag_bytes(self.slot)

    def evaluate(self, value: int | None) -> Observation:
        if value is None:
            raise SequinConditionError(
                f"replication slot {self.slot!r} does not exist (or has no confirmed position)", {"slot": self.slot}
            )
        exceeded = value > self.threshold_bytes
        word = "above" if exceeded else "within"
        return Observation(
            exceeded == (self.fire_when == "exceeds"),
            f"slot {self.slot!r} lags {value} bytes, {word} the threshold of {self.threshold_bytes}",
            {
                "slot": self.slot,
                "lag_bytes": value,
                "threshold_bytes": self.threshold_bytes,
                "fire_when": self.fire_when,
            },
        )


class HeartbeatTrigger(SequinPollingTrigger):
    """Fires when the stream app of ``database`` has not recorded a batch for more than
    ``max_age_seconds`` -- or never has (``fire_when="within"``: when its heartbeat is fresh)."""

    def __init__(self, *, database: str, max_age_seconds: float, fire_when: str = "exceeds", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.database = database
        self.max_age_seconds = check_non_negative("max_age_seconds", max_age_seconds)
        self.fire_when = check_fire_when(fire_when)

    def condition_kwargs(self) -> dict[str, Any]:
        return {"database": self.database, "max_age_seconds": self.max_age_seconds, "fire_when": self.fire_when}

    def measure(self, hook: SequinHook) -> float | None:
        return hook.heartbeat_age_seconds(self.database)

    async def ameasure(self, hook: SequinHook) -> float | None:
        return await hook.aheartbeat_age_seconds(self.database)

    def evaluate(self, value: float | None) -> Observation:
        stale = value is None or value > self.max_age_seconds
        seen = "no heartbeat recorded" if value is None else f"last heartbeat {value:.1f}s ago"
        word = "stale" if stale else "fresh"
        return Observation(
            stale == (self.fire_when == "exceeds"),
            f"stream of database {self.database!r}: {seen}, {word} (max age {self.max_age_seconds:g}s)",
            {
                "database": self.database,
                "age_seconds": value,
                "max_age_seconds": self.max_age_seconds,
                "fire_when": self.fire_when,
            },
        )


class ParkedMessagesTrigger(SequinPollingTrigger):
    """Fires when more than ``threshold`` messages are parked in the buffer, for ``sink`` or for all
    sinks together (``fire_when="within"``: when at most ``threshold`` are, e.g. drained to 0)."""

    def __init__(
        self, *, sink: str | None = None, threshold: int = 0, fire_when: str = "exceeds", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sink = sink or None
        self.threshold = int(check_non_negative("threshold", threshold))
        self.fire_when = check_fire_when(fire_when)

    def condition_kwargs(self) -> dict[str, Any]:
        return {"sink": self.sink, "threshold": self.threshold, "fire_when": self.fire_when}

    def measure(self, hook: SequinHook) -> dict[str, dict[str, int]]:
        return hook.parked_counts(self.sink)

    async def ameasure(self, hook: SequinHook) -> dict[str, dict[str, int]]:
        return await hook.aparked_counts(self.sink)

    def evaluate(self, value: dict[str, dict[str, int]]) -> Observation:
        by_sink = {sink: counts.get("parked", 0) for sink, counts in sorted(value.items())}
        parked = sum(by_sink.values())
        discarded = sum(counts.get("discarded", 0) for counts in value.values())
        exceeded = parked > self.threshold
        scope = f"sink {self.sink!r}" if self.sink else "all sinks"
        word = "above" if exceeded else "within"
        return Observation(
            exceeded == (self.fire_when == "exceeds"),
            f"{parked} parked messages in {scope}, {word} the threshold of {self.threshold}",
            {
                "sink": self.sink,
                "parked": parked,
                "discarded": discarded,
                "parked_by_sink": by_sink,
                "threshold": self.threshold,
                "fire_when": self.fire_when,
            },
        )


class BackfillCompletedTrigger(SequinPollingTrigger):
    """Fires when backfill ``backfill_id`` is ``completed``; ``failed`` or ``cancelled`` is an error
    event carrying the backfill's error."""

    def __init__(self, *, backfill_id: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backfill_id = int(backfill_id)

    def condition_kwargs(self) -> dict[str, Any]:
        return {"backfill_id": self.backfill_id}

    def measure(self, hook: SequinHook) -> store.Backfill:
        return hook.backfill(self.backfill_id)

    async def ameasure(self, hook: SequinHook) -> store.Backfill:
        return await hook.abackfill(self.backfill_id)

    def evaluate(self, value: store.Backfill) -> Observation:
        progress = progress_line(value)
        payload = {
            "backfill_id": value.id,
            "state": value.state,
            "sink": value.sink,
            "table": f"{value.table_schema}.{value.table_name}",
            "rows_initial": value.rows_initial,
            "rows_processed": value.rows_processed,
            "rows_emitted": value.rows_emitted,
            "error": value.error,
            "progress": progress,
        }
        if value.state in BACKFILL_FAILED_STATES:
            raise SequinConditionError(
                f"backfill {value.id} {value.state}: {value.error or 'no error recorded'}", payload
            )
        return Observation(value.state == "completed", f"backfill {value.id}: {progress}", payload)
