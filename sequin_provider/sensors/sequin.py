"""Sensors on a Sequin deployment: slot lag, stream heartbeat, parked messages, backfill completion.

Deferrable by default: ``execute`` checks once and, if the condition does not hold yet, defers to
the matching trigger (``sequin_provider.triggers.sequin``) until it does or ``timeout`` passes.
With ``deferrable=False`` the sensor pokes like any sensor (``mode="poke"`` or ``"reschedule"``).
Both paths judge with the trigger's ``evaluate``, so they agree, and both return the same dict
(``status``, ``message`` and what was observed) as the task's XCom.

The threshold sensors fire on the *alert* by default (lag/age/parked count above the threshold);
``fire_when="within"`` waits for the healthy state instead. See the triggers module.
"""

from __future__ import annotations

import time
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout

from sequin_provider.airflow_errors import airflow_errors
from sequin_provider.hooks.sequin import SequinHook
from sequin_provider.triggers.sequin import (
    BackfillCompletedTrigger,
    HeartbeatTrigger,
    ParkedMessagesTrigger,
    SequinPollingTrigger,
    SlotLagTrigger,
)

if TYPE_CHECKING:
    from airflow.sdk import Context


class SequinConditionSensor(BaseSensorOperator):
    """Base: waits for the condition of the trigger that ``build_trigger`` returns.

    :param sequin_conn_id: the ``sequin`` connection.
    :param deferrable: wait in the triggerer (default) instead of a worker slot.
    """

    template_fields: Sequence[str] = ("sequin_conn_id",)
    ui_color = "#e8f4fd"

    def __init__(
        self, *, sequin_conn_id: str = SequinHook.default_conn_name, deferrable: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sequin_conn_id = sequin_conn_id
        self.deferrable = deferrable

    @cached_property
    def hook(self) -> SequinHook:
        """The hook (built on first use, after templates are rendered)."""
        return SequinHook(self.sequin_conn_id)

    def build_trigger(self, end_time: float | None) -> SequinPollingTrigger:
        """The trigger that watches this sensor's condition (also used, without I/O, to judge pokes)."""
        raise NotImplementedError

    def poke(self, context: Context) -> PokeReturnValue:
        """Measure once and judge; an impossible condition (missing slot, failed backfill) fails the task."""
        trigger = self.build_trigger(end_time=None)
        with airflow_errors():
            observation = trigger.evaluate(trigger.measure(self.hook))
        self.log.info("%s", observation.message)
        return PokeReturnValue(observation.done, observation.event("success") if observation.done else None)

    def execute(self, context: Context) -> Any:
        """Poke once; if not done, defer to the trigger until ``timeout`` (deferrable mode)."""
        if not self.deferrable:
            return super().execute(context)
        first = self.poke(context)
        if first.is_done:
            return first.xcom_value
        self.defer(
            trigger=self.build_trigger(end_time=time.time() + self.timeout),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume from the trigger: return its payload on success, fail on a timeout or an error."""
        status = event.get("status")
        message = str(event.get("message") or event)
        if status == "success":
            self.log.info("%s", message)
            return event
        if status == "timeout":
            raise AirflowSensorTimeout(message)
        raise AirflowException(message)


class ReplicationSlotLagSensor(SequinConditionSensor):
    """Waits until replication slot ``slot`` lags more than ``threshold_bytes`` (an alert), or with
    ``fire_when="within"`` until it lags at most that much (caught up). A missing slot fails."""

    template_fields: Sequence[str] = ("sequin_conn_id", "slot", "threshold_bytes", "fire_when")

    def __init__(self, *, slot: str, threshold_bytes: int | str, fire_when: str = "exceeds", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slot = slot
        self.threshold_bytes = threshold_bytes
        self.fire_when = fire_when

    def build_trigger(self, end_time: float | None) -> SlotLagTrigger:
        return SlotLagTrigger(
            slot=self.slot,
            threshold_bytes=int(self.threshold_bytes),
            fire_when=self.fire_when,
            sequin_conn_id=self.sequin_conn_id,
            poke_interval=self.poke_interval,
            end_time=end_time,
        )


class StreamHeartbeatSensor(SequinConditionSensor):
    """Waits until the stream app of ``database`` has been silent for more than ``max_age_seconds``
    (or never reported; an alert), or with ``fire_when="within"`` until it reports (alive)."""

    template_fields: Sequence[str] = ("sequin_conn_id", "database", "max_age_seconds", "fire_when")

    def __init__(
        self, *, database: str, max_age_seconds: float | str, fire_when: str = "exceeds", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.database = database
        self.max_age_seconds = max_age_seconds
        self.fire_when = fire_when

    def build_trigger(self, end_time: float | None) -> HeartbeatTrigger:
        return HeartbeatTrigger(
            database=self.database,
            max_age_seconds=float(self.max_age_seconds),
            fire_when=self.fire_when,
            sequin_conn_id=self.sequin_conn_id,
            poke_interval=self.poke_interval,
            end_time=end_time,
        )


class ParkedMessagesSensor(SequinConditionSensor):
    """Waits until more than ``threshold`` messages are parked (of ``sink``, or of all sinks; an
    alert), or with ``fire_when="within"`` until at most ``threshold`` are (drained)."""

    template_fields: Sequence[str] = ("sequin_conn_id", "sink", "threshold", "fire_when")

    def __init__(
        self, *, sink: str | None = None, threshold: int | str = 0, fire_when: str = "exceeds", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sink = sink
        self.threshold = threshold
        self.fire_when = fire_when

    def build_trigger(self, end_time: float | None) -> ParkedMessagesTrigger:
        return ParkedMessagesTrigger(
            sink=self.sink or None,
            threshold=int(self.threshold),
            fire_when=self.fire_when,
            sequin_conn_id=self.sequin_conn_id,
            poke_interval=self.poke_interval,
            end_time=end_time,
        )


class BackfillCompletedSensor(SequinConditionSensor):
    """Waits until backfill ``backfill_id`` is completed; failed or cancelled fails the task with
    the backfill's error. ``backfill_id`` may be templated (e.g. an upstream task's XCom)."""

    template_fields: Sequence[str] = ("sequin_conn_id", "backfill_id")

    def __init__(self, *, backfill_id: int | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backfill_id = backfill_id

    def build_trigger(self, end_time: float | None) -> BackfillCompletedTrigger:
        return BackfillCompletedTrigger(
            backfill_id=int(self.backfill_id),
            sequin_conn_id=self.sequin_conn_id,
            poke_interval=self.poke_interval,
            end_time=end_time,
        )
