"""``sequin_monitoring``: every 5 minutes, check replication slot lag, the stream app's heartbeat and
the parked messages; a failed check sends an alert (``SequinNotifier``) to a webhook.

Each sensor waits for the *healthy* state (``fire_when="within"``), deferred to the triggerer: it
succeeds at once when healthy, and fails when the state stays unhealthy for ``timeout`` (4 minutes,
inside the 5-minute schedule) or cannot be measured (slot gone, database unreachable). The
failure callback posts the alert. (``soft_fail`` is not used: it would also turn those errors into
skips, and a missing slot must page someone.)

Thresholds and names: Airflow Variables read at run time (``sequin_slot``, ``sequin_database``,
``sequin_max_lag_bytes``, ``sequin_max_heartbeat_age``, ``sequin_max_parked``), else the run's
params, whose defaults come from the DAG processor's environment (``SEQUIN_SLOT`` = ``sequin_slot``,
``SEQUIN_DATABASE`` = ``app``, ``SEQUIN_MAX_LAG_BYTES`` = 1 GiB, ``SEQUIN_MAX_HEARTBEAT_AGE`` = 120 s,
``SEQUIN_MAX_PARKED`` = 0). Webhook: ``SEQUIN_ALERT_WEBHOOK_URL``, else the Variable
``sequin_alert_webhook_url``. How long an unhealthy state may last before the alert:
``SEQUIN_CHECK_TIMEOUT`` (seconds, default 240), checked every ``SEQUIN_CHECK_POKE_INTERVAL``
(default 30).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag

from sequin_provider.notifications.sequin import alert_from_environment
from sequin_provider.sensors.sequin import ParkedMessagesSensor, ReplicationSlotLagSensor, StreamHeartbeatSensor

CHECK = {
    "deferrable": True,
    "fire_when": "within",
    "retries": 0,
    "poke_interval": float(os.environ.get("SEQUIN_CHECK_POKE_INTERVAL", "30")),
    "timeout": float(os.environ.get("SEQUIN_CHECK_TIMEOUT", "240")),
}


@dag(
    dag_id="sequin_monitoring",
    schedule="*/5 * * * *",
    start_date=datetime(2025, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(minutes=5),
    tags=["sequin"],
    doc_md=__doc__,
    params={
        "slot": Param(os.environ.get("SEQUIN_SLOT", "sequin_slot"), type="string"),
        "database": Param(os.environ.get("SEQUIN_DATABASE", "app"), type="string"),
        "max_lag_bytes": Param(int(os.environ.get("SEQUIN_MAX_LAG_BYTES", str(1 << 30))), type="integer", minimum=0),
        "max_heartbeat_age": Param(float(os.environ.get("SEQUIN_MAX_HEARTBEAT_AGE", "120")), type="number", minimum=0),
        "max_parked": Param(int(os.environ.get("SEQUIN_MAX_PARKED", "0")), type="integer", minimum=0),
    },
)
def sequin_monitoring() -> None:
    ReplicationSlotLagSensor(
        task_id="slot_lag",
        slot="{{ var.value.get('sequin_slot', params.slot) }}",
        threshold_bytes="{{ var.value.get('sequin_max_lag_bytes', params.max_lag_bytes) }}",
        on_failure_callback=alert_from_environment("Sequin: replication slot lagging"),
        **CHECK,
    )
    StreamHeartbeatSensor(
        task_id="stream_heartbeat",
        database="{{ var.value.get('sequin_database', params.database) }}",
        max_age_seconds="{{ var.value.get('sequin_max_heartbeat_age', params.max_heartbeat_age) }}",
        on_failure_callback=alert_from_environment("Sequin: stream app heartbeat stale"),
        **CHECK,
    )
    ParkedMessagesSensor(
        task_id="parked_messages",
        threshold="{{ var.value.get('sequin_max_parked', params.max_parked) }}",
        on_failure_callback=alert_from_environment("Sequin: messages parked"),
        **CHECK,
    )


sequin_monitoring()
